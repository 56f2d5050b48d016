#!/usr/bin/env bash
# Starts one HDFS role of docker-compose.yml: namenode, datanode, or init (the one-shot that prepares
# the checkpoint root).  A script rather than an inline `bash -c`: the image's entrypoint passes the
# command on, and a single-word argument reaches bash intact however the entrypoint expands it.
set -euo pipefail

# Named volumes start out owned by root, the image runs as its unprivileged `hadoop` user (which
# has passwordless sudo): take the directory over before the daemon needs it.
own() {
    if [ ! -w "$1" ]; then
        sudo -n chown -R "$(id -u)" "$1"
    fi
}

case "${1:-}" in
namenode)
    own /hadoop/dfs/name
    # Format exactly once, on an empty volume; a formatted one holds the namespace and must be kept.
    if [ ! -f /hadoop/dfs/name/current/VERSION ]; then
        hdfs namenode -format -nonInteractive
    fi
    exec hdfs namenode
    ;;
datanode)
    own /hadoop/dfs/data
    exec hdfs datanode
    ;;
init)
    # Runs as the user that started the namenode, the HDFS superuser, and hands the checkpoint root
    # to `airflow`: the user the drivers write as (HADOOP_USER_NAME) and the checkpoint connection's.
    hdfs dfsadmin -safemode wait
    # A checkpoint write needs a datanode, not just a namenode out of safe mode.
    live=""
    for _ in $(seq 60); do
        if hdfs dfsadmin -report -live 2>/dev/null | grep -q 'Live datanodes ([1-9]'; then
            live=yes
            break
        fi
        sleep 2
    done
    if [ -z "$live" ]; then
        echo "no live datanode registered with the namenode after 120 s: see 'docker compose logs datanode'" >&2
        exit 1
    fi
    hdfs dfs -mkdir -p /checkpoints
    hdfs dfs -chown airflow /checkpoints
    hdfs dfs -chmod 750 /checkpoints
    hdfs dfs -ls /
    ;;
*)
    echo "usage: $0 namenode|datanode|init" >&2
    exit 2
    ;;
esac
