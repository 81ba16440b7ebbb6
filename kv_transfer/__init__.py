"""KV transfer between disaggregated workers: payloads (payload.py), packing
a paged cache into them (pack.py), the sender/receiver interface (base.py) and
its transports (zmq, torch_dist, shaped), chosen by name in registry.py."""
from testbed.kv_transfer.base import Ack, KVReceiver, KVSender, TransferError
from testbed.kv_transfer.config import TransferConfig
from testbed.kv_transfer.pack import coalesce_runs, pack_kv, unpack_kv
from testbed.kv_transfer.payload import KVPayload, PayloadError
from testbed.kv_transfer.registry import make_receiver, make_sender
from testbed.kv_transfer.torch_dist import TorchDistGroup, start_rendezvous

__all__ = [
    "Ack", "KVPayload", "KVReceiver", "KVSender", "PayloadError", "TorchDistGroup", "TransferConfig",
    "TransferError", "coalesce_runs", "make_receiver", "make_sender", "pack_kv", "start_rendezvous",
    "unpack_kv",
]
