"""A real Prometheus scrapes a real ``kvtax serve`` through TLS and basic auth.

kvtax runs with ``--web.config.file`` (exporter-toolkit's format: a server certificate from a
throwaway CA and one bcrypt user) and ``--web.telemetry-path``. Prometheus scrapes it three ways:
with the CA and the right password (up), with a wrong password (401, down) and over plain HTTP
(down). No vLLM is needed: kvtax serves its own page whatever vLLM does. About 10 s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import bcrypt
import requests

from kvtax_dev.ports import refused_port
from kvtax_dev.testbed.promstack import PrometheusProcess, prometheus_config
from kvtax_dev.testbed.sidecar import KvtaxProcess
from kvtax_dev.testbed.tlscerts import make_certs

PASSWORD = "scrape-me"
PATH = "/kvtax/metrics"


def _targets_by_job(prom: PrometheusProcess) -> dict[str, dict[str, Any]]:
    return {t["labels"]["job"]: t for t in prom.targets()}


def test_prometheus_scrapes_kvtax_through_tls_and_basic_auth(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    web_config = tmp_path / "web.yml"
    web_config.write_text(
        "tls_server_config:\n"
        f"  cert_file: {certs.server_cert}\n"
        f"  key_file: {certs.server_key}\n"
        "basic_auth_users:\n"
        f"  prometheus: '{hashed}'\n"
    )
    # No vLLM, and nothing else on its port: kvtax_vllm_up 0, the page still served.
    with refused_port() as down:
        nothing = f"http://127.0.0.1:{down}"
        with KvtaxProcess(
            nothing,
            extra_args=[f"--web.config.file={web_config}", f"--web.telemetry-path={PATH}"],
            log_path=tmp_path / "kvtax.log",
            tls_ca=certs.ca,
        ) as kvtax:
            # Straight from a client first: the page needs the password, the probe does not.
            url = f"https://127.0.0.1:{kvtax.port}"
            assert requests.get(url + PATH, verify=str(certs.ca), timeout=5).status_code == 401
            page = requests.get(
                url + PATH, verify=str(certs.ca), auth=("prometheus", PASSWORD), timeout=5
            )
            assert page.status_code == 200
            assert "kvtax_build_info" in page.text
            assert (
                requests.get(url + "/healthz", verify=str(certs.ca), timeout=5).status_code == 200
            )

            target = [f"127.0.0.1:{kvtax.port}"]
            tls = {"ca_file": str(certs.ca)}
            secure = {"scheme": "https", "tls_config": tls, "metrics_path": PATH}
            config = prometheus_config(
                {"kvtax": target, "wrong-password": target, "plain-http": target},
                job_settings={
                    "kvtax": {
                        **secure,
                        "basic_auth": {"username": "prometheus", "password": PASSWORD},
                    },
                    "wrong-password": {
                        **secure,
                        "basic_auth": {"username": "prometheus", "password": "guess"},
                    },
                    "plain-http": {"metrics_path": PATH},
                },
            )
            with PrometheusProcess(config, log_path=tmp_path / "prom.log") as prom:
                seen: list[dict[str, dict[str, Any]]] = [{}]

                def settled() -> dict[str, dict[str, Any]]:
                    # The targets once each has the verdict its settings call for; until then
                    # none (falsy: poll again). A scrape that timed out (1 s, the interval) says
                    # nothing either way: a first TLS scrape on a busy machine can, and the
                    # target reads "down". One that never reaches its verdict fails.
                    t = seen[0] = _targets_by_job(prom)
                    done = (
                        len(t) == 3
                        and t["kvtax"]["health"] == "up"
                        and t["wrong-password"]["health"] == "down"
                        and "401" in t["wrong-password"]["lastError"]
                        and t["plain-http"]["health"] == "down"
                    )
                    return t if done else {}

                prom.wait_for(settled, what=lambda: f"each target's verdict (last: {seen[0]})")
                # kvtax's own series arrived in Prometheus through the TLS, authenticated scrape.
                series = prom.wait_for(
                    lambda: prom.query('kvtax_build_info{job="kvtax"}'),
                    what="kvtax_build_info stored",
                )
                assert len(series) == 1
                assert prom.query('kvtax_build_info{job="wrong-password"}') == []
            assert kvtax.stop() == 0
