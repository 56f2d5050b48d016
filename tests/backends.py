"""Which state database a driver scenario runs on in the default run, and which waits for ``make soak``.

A driver scenario on both databases costs a Spark driver's whole life twice, where what differs between
the two, the batch transaction, is proven on both by ``tests/integration/state/``.  The default run
takes PostgreSQL, the production database; SQLite, the embedded default, is the real-Airflow tier's
database, so a kill on it is proven there.  ``make soak`` runs the SQLite variant as well.
"""

from __future__ import annotations

import pytest

#: ``database_url`` for a driver scenario: PostgreSQL by default, SQLite too in ``make soak``.
POSTGRESQL_THEN_SQLITE_IN_SOAK = pytest.mark.parametrize(
    "database_url", ["postgresql", pytest.param("sqlite", marks=pytest.mark.soak)], indirect=True)
