"""Airflow's task state store as an operator sees it (``context["task_state_store"]``: get, set, delete),
kept across a task's tries as Airflow keeps it.  The operators' own use of it is under test, not Airflow's
store (the real-Airflow tier runs that one)."""

from __future__ import annotations

import json


class TaskStateStore(dict):
    def set(self, key, value):
        # Airflow's store takes JSON values only, and refuses what JSON would change (a tuple)
        if json.loads(json.dumps(value)) != value:
            raise ValueError(f"{key}: not a JSON value: {value!r}")
        self[key] = value

    def delete(self, key):
        self.pop(key, None)
