"""A running Optuna trial's attributes written together: one storage transaction, not one per attribute.

A told trial carried about ten attributes and constraints (flags, predictions, status, outcome,
cause, metrics, preemptions, the constraints), each its own commit (an fsync on SQLite) through
Optuna's ``Trial.set_user_attr`` / ``set_constraint``: a third of the driver's storage time per trial.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optuna

from servetune.records._storage import RetryingStorage

__all__ = ["set_trial_attrs"]


def set_trial_attrs(trial: optuna.trial.Trial, user: Mapping[str, Any],
                    constraints: Mapping[str, float] | None = None) -> None:
    """``trial.set_user_attr`` for each of ``user`` and ``trial.set_constraint`` for each of
    ``constraints``, as one storage write where the storage can batch them
    (:meth:`RetryingStorage.set_trial_attrs`). The trial reads them back as if set one by one.

    Example:
        >>> import optuna
        >>> from servetune.records._storage import open_storage
        >>> study = optuna.create_study(storage=open_storage("sqlite:///:memory:"))
        >>> trial = study.ask()
        >>> set_trial_attrs(trial, {"status": "ok", "preemptions": 0}, {"startup": -1.0})
        >>> trial.user_attrs, study.trials[0].system_attrs["constraints:startup"]
        ({'status': 'ok', 'preemptions': 0}, -1.0)
    """
    storage = trial.storage
    if not isinstance(storage, RetryingStorage):
        for key, value in user.items():
            trial.set_user_attr(key, value)
        for key, value in (constraints or {}).items():
            trial.set_constraint(key, value)
        return
    system = {}
    for key, value in (constraints or {}).items():
        value = float(value)
        if value != value:
            raise ValueError(f"Attempted to set a constraint for {key!r}, but NaN is not allowed.")
        system[f"constraints:{key}"] = value  # Optuna's own key (optuna.study._constrained_optimization)
    storage.set_trial_attrs(trial._trial_id, dict(user), system)
    frozen = trial._cached_frozen_trial  # what trial.user_attrs / system_attrs read
    frozen.user_attrs.update(user)
    frozen.system_attrs.update(system)
