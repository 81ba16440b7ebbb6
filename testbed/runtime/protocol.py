"""Messages between the frontend (router, mode controller) and workers.

Plain dicts with a "type" key, msgpack-able (never pickled): the real runtime
sends them over ZMQ, the simulator hands them over in virtual-time order. A
request travels as its fields; token ids as lists of ints.

frontend -> worker: add, reserve, prefill, release, abort, stop
worker -> frontend: ready, tokens, finished, reserved, rejected, prefilled,
                    kv_received, failed, iterations, stats
"""
from __future__ import annotations

from testbed.request import Request, RequestStatus, SamplingParams


def request_to_msg(req: Request) -> dict:
    sp = req.sampling
    return {"id": req.request_id, "prompt": list(req.prompt_token_ids), "max_tokens": req.max_tokens,
            "arrival_s": req.arrival_s, "temperature": sp.temperature, "top_p": sp.top_p,
            "seed": sp.seed, "ignore_eos": sp.ignore_eos, "eos": sp.eos_token_id}


def request_from_msg(m: dict) -> Request:
    return Request(m["id"], m["prompt"], m["max_tokens"], m["arrival_s"],
                   SamplingParams(m["temperature"], m["top_p"], m["seed"], m["ignore_eos"], m["eos"]))


def finished_msg(req: Request) -> dict:
    return {"type": "finished", "id": req.request_id, "status": req.status.value,
            "error": req.error, "finish_s": req.finish_s, "first_scheduled_s": req.first_scheduled_s,
            "num_preemptions": req.num_preemptions}


def failed(req_id: str, error: str, status: RequestStatus = RequestStatus.FAILED) -> dict:
    return {"type": "finished", "id": req_id, "status": status.value, "error": error,
            "finish_s": None, "first_scheduled_s": None, "num_preemptions": 0}
