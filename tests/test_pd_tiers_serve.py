"""P/D and KV tiers on the same workers, in real `kvloop serve` processes (the simulator: the
accounting; docs/tiers.md "P/D and tiers on one worker"). Each worker has one connector list
(`kvloop.kv_transfer.multi.MultiConnector`): loads from the first that has the blocks, saves
to all.

- A decode worker with a disk tier stores the prompt it pulled from its prefill worker; after
  a restart (and with the prefill worker gone) it answers that prompt from its disk, the
  cached tokens reported.
- A prefill worker with a shared store (`file://`) fills it while prefilling for decode; a
  second worker reading the store answers the prompt from it.
"""

from __future__ import annotations

import os

import pytest

from .conftest import serving, wait_until
from .test_pd_serve import FLEET_ENV, completion, kv_config, pd, prefill
from .test_tiers_serve import PROMPT, cached_tokens

pytestmark = pytest.mark.processes

BS = 16
FULL_BLOCKS = len(PROMPT) // BS       # 12 full blocks (and 8 tokens)
SIM = ["--model", "sim", "--num-gpu-blocks-override", "64", "--max-model-len", "1024",
       "--debug-check-invariants", "--port", "0"]


def test_decode_worker_answers_from_its_disk_what_its_prefill_worker_prefilled(
        tmp_path_factory):
    disk = tmp_path_factory.mktemp("pd-disk")
    d_args = [*SIM, "--role", "decode", "--kv-transfer-config", kv_config(),
              "--kv-disk-path", str(disk), "--kv-disk-size", "0.05"]
    with serving(tmp_path_factory, "pd-tier-p", [*SIM, "--kv-transfer-config", kv_config()],
                 env=FLEET_ENV) as p, \
            serving(tmp_path_factory, "pd-tier-d1", d_args, env=FLEET_ENV) as d:
        p_answer, r = pd(p, d, completion(PROMPT))
        assert r.status_code == 200, r.text
        assert p_answer["kv_transfer_params"]["do_remote_prefill"] is True
        wait_until(lambda: d.metric("kvloop:kv_transfers_total", side="recv") == 1, 10,
                   "D's load from P")
        wait_until(lambda: len(os.listdir(disk)) >= FULL_BLOCKS, 10, "the prompt on D's disk")
    with serving(tmp_path_factory, "pd-tier-d2", d_args, env=FLEET_ENV) as d:   # P is gone
        assert cached_tokens(d, PROMPT) == FULL_BLOCKS * BS
        assert d.metric("vllm:external_prefix_cache_hits_total") == FULL_BLOCKS * BS


def test_prefill_worker_fills_a_shared_store_a_second_worker_reads(tmp_path_factory):
    store = f"file://{tmp_path_factory.mktemp('pd-shared')}"
    tier = ["--kv-transfer-config", kv_config(), "--kv-shared-store", store]
    with serving(tmp_path_factory, "pd-shared-p", [*SIM, *tier], env=FLEET_ENV) as p, \
            serving(tmp_path_factory, "pd-shared-d", [*SIM, "--role", "decode", *tier],
                    env=FLEET_ENV) as d:
        answer = prefill(p, completion(PROMPT))
        assert answer["kv_transfer_params"]["do_remote_prefill"] is True   # P holds them too
        files = store.removeprefix("file://")
        wait_until(lambda: sum(len(f) for _, _, f in os.walk(files)) >= FULL_BLOCKS, 10,
                   "the prompt in the shared store")
        assert cached_tokens(d, PROMPT) == FULL_BLOCKS * BS     # no P/D leg: from the store
        assert d.metric("vllm:prompt_tokens_by_source_total",
                        source="external_kv_transfer") == FULL_BLOCKS * BS
