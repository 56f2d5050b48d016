"""The stream status page: a read-only view of the state database inside Airflow's UI."""

#: Where Airflow's api-server mounts the page and its JSON (the operators' "Driver log" link points here).
URL_PREFIX = "/stream-status"
