"""Messages between the frontend (router, mode controller) and workers.

Plain dicts with a "type" key, msgpack-able (never pickled): the real runtime
sends them over ZMQ, the simulator hands them over in virtual-time order. A
request travels as its fields; token ids as lists of ints.

frontend -> worker: add, prefill, reserve, release, abort, connect, stop (ping
                    only wakes the route)
worker -> frontend: ready; tokens (items [id, token, engine_s, index]: a disagg
                    request's first token and the rest come from two workers on
                    two sockets, the index restores their order); finished
                    (also for failed and aborted requests); preempted; iteration
                    (one per engine step, with the worker's free KV blocks);
                    free_blocks (a decode worker that freed blocks outside a
                    step); reserved / rejected; prefilled; kv_received; stats
                    (at stop: free blocks, leaks); error (a worker crashed)
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
