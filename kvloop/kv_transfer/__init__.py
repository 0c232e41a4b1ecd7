"""KV transfer between engines (prefill/decode disaggregation, docs/disaggregation.md):
`KvloopConnector` (the core's `KVConnector`), its side channel (`server`: P's ROUTER thread;
`client`: D's transfer thread), the messages (`protocol`), P's leases (`leases`), the
shared-memory transport (`shm`) and `kv_transfer_params` (`params`).

Importing the package imports zmq; only the engine process and `LLM` build a connector.
"""

from kvloop.kv_transfer.connector import KvloopConnector, KvloopConnectorMetadata, make_connector

__all__ = ["KvloopConnector", "KvloopConnectorMetadata", "make_connector"]
