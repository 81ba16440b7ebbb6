"""make_sender / make_receiver: the transport classes chosen by name
(`transfer.transport`), so that modes and workers never test a flag.

`shaped` wraps the sender of `transfer.shaped_inner` and receives with that
transport's receiver; `transfer.fault_corrupt_nth` wraps any sender in the
corrupting fault injector. torch_dist needs the worker's TorchDistGroup.
"""
from __future__ import annotations

from testbed.kv_transfer.base import KVReceiver, KVSender
from testbed.kv_transfer.config import TransferConfig
from testbed.kv_transfer.faults import CorruptingSender
from testbed.kv_transfer.shaped import ShapedSender
from testbed.kv_transfer.torch_dist import TorchDistGroup, TorchDistReceiver, TorchDistSender
from testbed.kv_transfer.zmq_transport import ZmqReceiver, ZmqSender


def _need_group(group: TorchDistGroup | None) -> TorchDistGroup:
    if group is None:
        raise ValueError("transfer.transport=torch_dist needs the worker's TorchDistGroup: pass group=... "
                         "(the launcher assigns ranks and the rendezvous address)")
    return group


def _real_name(cfg: TransferConfig) -> str:
    return cfg.shaped_inner if cfg.transport == "shaped" else cfg.transport


def make_sender(cfg: TransferConfig, *, name: str | None = None,
                group: TorchDistGroup | None = None, curve=None) -> KVSender:
    """`curve`: the run's CURVE keys (kv_transfer/curve.py), None on loopback."""
    cfg.validate()
    sender: KVSender
    if _real_name(cfg) == "zmq":
        sender = ZmqSender(cfg, name, curve)
    else:
        sender = TorchDistSender(cfg, _need_group(group), name, curve)
    if cfg.transport == "shaped":
        sender = ShapedSender(sender, cfg.rate_bytes_per_s, cfg.latency_ms / 1000, cfg.timeout_s)
    if cfg.fault_corrupt_nth:
        sender = CorruptingSender(sender, cfg.fault_corrupt_nth)
    return sender


def make_receiver(cfg: TransferConfig, *, group: TorchDistGroup | None = None, curve=None) -> KVReceiver:
    cfg.validate()
    if _real_name(cfg) == "zmq":
        return ZmqReceiver(cfg, curve=curve)
    return TorchDistReceiver(cfg, _need_group(group), curve=curve)
