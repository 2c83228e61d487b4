"""servetune: which vLLM flags should this model run with on this GPU?

An Optuna study proposes vLLM flag sets, Ray actors run them (real ``vllm serve`` where a GPU is
visible, the simulated vLLM V1 engine elsewhere), MLflow and a Parquet dataset record every
trial, and the best preemption-free configuration comes out as a ready ``vllm serve`` command.
Start with ``servetune tune jobs/quickstart.yaml``; see docs/architecture.md for the map.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
