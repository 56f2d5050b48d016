"""The Airflow plugin: the status page's app on the api-server, and a "Streams" entry in the UI's menu."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from airflow_stream_provider.plugins.status import URL_PREFIX
from airflow_stream_provider.plugins.status.app import create_app


class StreamStatusPlugin(AirflowPlugin):
    name = "stream_status"
    fastapi_apps = [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "Stream status"}]
    external_views = [{"name": "Streams", "href": URL_PREFIX.lstrip("/") + "/", "destination": "nav",
                       "url_route": "streams", "category": "browse"}]
