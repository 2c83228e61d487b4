"""A running Optuna trial's attributes written together: one storage transaction, not one per attribute.

A told trial carried about ten attributes and constraints (flags, predictions, status, outcome,
cause, metrics, preemptions, the constraints), each its own commit (an fsync on SQLite) through
Optuna's ``Trial.set_user_attr`` / ``set_constraint``: a third of the driver's storage time per trial.
What is known when the trial is asked (its flags, the planner's prediction) is kept on the trial
(:func:`defer_trial_attrs`) and written with what its result adds, just before it is told: one
transaction per trial. A trial killed while it runs is measured again from its params (its
Optuna record holds no servetune status, :mod:`servetune.study`'s resume re-queues it).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import optuna

from servetune.records._storage import RetryingStorage

__all__ = ["set_trial_attrs", "defer_trial_attrs"]

#: User attributes kept on a running trial until :func:`set_trial_attrs` writes them.
_DEFERRED: weakref.WeakKeyDictionary[optuna.trial.Trial, dict[str, Any]] = weakref.WeakKeyDictionary()


def defer_trial_attrs(trial: optuna.trial.Trial, user: Mapping[str, Any]) -> None:
    """User attributes of ``trial`` that the next :func:`set_trial_attrs` of it writes, in its own
    transaction; ``trial.user_attrs`` shows them at once (the storage does not hold them until then).

    Example:
        >>> import optuna
        >>> from servetune.records._storage import open_storage
        >>> study = optuna.create_study(storage=open_storage("sqlite:///:memory:"))
        >>> trial = study.ask()
        >>> defer_trial_attrs(trial, {"flags": {"max_num_seqs": 64}})
        >>> trial.user_attrs, study.trials[0].user_attrs
        ({'flags': {'max_num_seqs': 64}}, {})
        >>> set_trial_attrs(trial, {"status": "ok"})
        >>> study.trials[0].user_attrs
        {'flags': {'max_num_seqs': 64}, 'status': 'ok'}
    """
    _DEFERRED.setdefault(trial, {}).update(user)
    trial._cached_frozen_trial.user_attrs.update(user)  # what trial.user_attrs reads


def set_trial_attrs(trial: optuna.trial.Trial, user: Mapping[str, Any],
                    constraints: Mapping[str, float] | None = None) -> None:
    """``trial.set_user_attr`` for each of ``user`` and ``trial.set_constraint`` for each of
    ``constraints``, as one storage write where the storage can batch them
    (:meth:`RetryingStorage.set_trial_attrs`), with what :func:`defer_trial_attrs` kept on it
    (first, so that ``user`` wins a shared key). The trial reads them back as if set one by one.

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
    user = {**_DEFERRED.get(trial, {}), **user}
    if not isinstance(storage, RetryingStorage):
        for key, value in user.items():
            trial.set_user_attr(key, value)
        for key, value in (constraints or {}).items():
            trial.set_constraint(key, value)
        _DEFERRED.pop(trial, None)
        return
    system = {}
    for key, value in (constraints or {}).items():
        value = float(value)
        if value != value:
            raise ValueError(f"Attempted to set a constraint for {key!r}, but NaN is not allowed.")
        system[f"constraints:{key}"] = value  # Optuna's own key (optuna.study._constrained_optimization)
    storage.set_trial_attrs(trial._trial_id, user, system)
    _DEFERRED.pop(trial, None)
    frozen = trial._cached_frozen_trial  # what trial.user_attrs / system_attrs read
    frozen.user_attrs.update(user)
    frozen.system_attrs.update(system)
