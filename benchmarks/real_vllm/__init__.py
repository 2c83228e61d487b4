"""What runs on the GPU host (collect.py, gemm_probe.py, trace_steps.py), importable here as ``real_vllm``."""
