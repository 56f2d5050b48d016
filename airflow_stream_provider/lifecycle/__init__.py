"""The Airflow side of a stream job's life: the controller's steps and what they wait for."""
