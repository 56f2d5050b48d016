#!/usr/bin/env bash
# One-shot setup of the Airflow side of docker-compose.yml: metadata database, admin user, and the
# connections and Variables the stream DAGs use.  Safe to rerun on every `docker compose up`: what
# exists is kept, so a connection edited in the UI is not reset by a restart.
set -euo pipefail

: "${STREAM_DB_PASSWORD:?set STREAM_DB_PASSWORD}"
: "${AIRFLOW_ADMIN_USER:?set AIRFLOW_ADMIN_USER}"
: "${AIRFLOW_ADMIN_PASSWORD:?set AIRFLOW_ADMIN_PASSWORD}"

airflow db migrate

# Prints a notice and succeeds when the user exists.
airflow users create --role Admin --username "$AIRFLOW_ADMIN_USER" --password "$AIRFLOW_ADMIN_PASSWORD" \
    --firstname Stream --lastname Admin --email "${AIRFLOW_ADMIN_EMAIL:-admin@example.org}"

connection() {  # connection CONN_ID ARGS...: add it unless it exists
    local conn_id=$1
    shift
    if airflow connections get "$conn_id" >/dev/null 2>&1; then
        echo "connection $conn_id exists: kept"
    else
        airflow connections add "$conn_id" "$@"
    fi
}

variable() {  # variable KEY VALUE: set it unless it exists
    if airflow variables get "$1" >/dev/null 2>&1; then
        echo "variable $1 exists: kept"
    else
        airflow variables set "$1" "$2"
    fi
}

# State and results database.  The password stays in the connection; the hook hands it to each driver
# in its environment, never on a command line.
connection stream_state_default --conn-type stream_state --conn-host postgres --conn-port 5432 \
    --conn-schema stream --conn-login stream --conn-password "$STREAM_DB_PASSWORD"

# The internal listener: drivers, executors and the triggerer all run on the compose network.
connection stream_kafka_default --conn-type stream_kafka --conn-extra '{"bootstrap_servers": "kafka:19092"}'

# Client deploy mode: the only one Spark standalone offers Python applications.
connection spark_default --conn-type spark --conn-host spark://spark-master --conn-port 7077 \
    --conn-extra '{"deploy-mode": "client", "spark-binary": "spark-submit"}'

# WebHDFS for archiving and copying checkpoint generations (the hook's default connection id); the
# user owns /checkpoints (hdfs-init) and is the one drivers write as (HADOOP_USER_NAME).
connection checkpoint_default --conn-type stream_checkpoint --conn-host namenode --conn-port 9870 \
    --conn-login airflow --conn-extra '{"use_ssl": false}'

# The job the four stream DAGs share (dags/stream_job.py): its spec, its code, and how drivers start.
# Checkpoints go to HDFS; the JVM Kafka connector is on the image (spark.jars.packages).
variable stream_job_spec '{"job_id": "events", "version": "1.0",
  "checkpoint_root": "hdfs://namenode:8020/checkpoints",
  "kafka": {"topics": ["events"], "source": "jvm", "max_offsets_per_trigger": 10000}}'
variable stream_job_application /opt/airflow/spark_jobs/events_job.py
variable stream_checkpoint_conn_id checkpoint_default
variable stream_reset_policy after_preflight

echo "Airflow is set up: connections and Variables are in place."
