"""KV transfer between disaggregated workers: payloads (payload.py), packing
a paged cache into them (pack.py), the sender/receiver interface (base.py) and
its transports (zmq, torch_dist, shaped), chosen by name in registry.py.

Names are resolved on first use, so that reading a TransferConfig (every run
config does) does not import torch: the simulator starts in a fraction of the time."""
from __future__ import annotations

import importlib

_EXPORTS = {
    "Ack": "base", "KVReceiver": "base", "KVSender": "base", "TransferError": "base",
    "TransferConfig": "config",
    "coalesce_runs": "pack", "pack_kv": "pack", "unpack_kv": "pack", "view_kv": "pack",
    "KVPayload": "payload", "PayloadError": "payload",
    "make_receiver": "registry", "make_sender": "registry",
    "TorchDistGroup": "torch_dist", "start_rendezvous": "torch_dist",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'testbed.kv_transfer' has no attribute '{name}'")
    return getattr(importlib.import_module(f"testbed.kv_transfer.{_EXPORTS[name]}"), name)
