"""A vLLM server's OpenTelemetry trace as a workload (`trace_format=otel`):
each `llm_request` span (vLLM's `--otlp-traces-endpoint`, exported as OTLP
JSON, one export per line, optionally gzipped) is one request arriving at the
span's start, with `gen_ai.usage.prompt_tokens` prompt tokens and
`gen_ai.request.max_tokens` output tokens (the server's replay runs with
ignore_eos, so every request produced max_tokens). Replaying a server's own
trace on `runtime=sim` is how an engine preset is checked against it
(experiments/benchmarks/bench_engine_presets.py)."""
from __future__ import annotations

from pathlib import Path

from testbed.jsonl import jsonl_objects
from testbed.text_lines import MAX_LINE_BYTES
from testbed.workloads.readers import TraceRow, _count

SPAN = "llm_request"
PROMPT, OUTPUT = "gen_ai.usage.prompt_tokens", "gen_ai.request.max_tokens"


def _attributes(span: dict, where: str) -> dict:
    out = {}
    for a in span.get("attributes", []):
        if not isinstance(a, dict) or "key" not in a or not isinstance(a.get("value"), dict) or not a["value"]:
            raise ValueError(f"{where}: a span attribute is not {{key, value: {{...Value}}}}: {str(a)[:80]}")
        out[a["key"]] = next(iter(a["value"].values()))
    return out


def _spans(obj: dict, where: str):
    resource_spans = obj.get("resourceSpans")
    if not isinstance(resource_spans, list):
        raise ValueError(f"{where}: not an OTLP JSON export (no resourceSpans list); give the trace that "
                         "vLLM's --otlp-traces-endpoint collector wrote")
    for rs in resource_spans:
        for ss in rs.get("scopeSpans", []) if isinstance(rs, dict) else []:
            yield from (ss.get("spans", []) if isinstance(ss, dict) else [])


class OtelReader:
    def read(self, path: Path, limit: int | None = None, max_line_bytes: int = 1 << 24) -> list[TraceRow]:
        rows = []
        for line, obj in jsonl_objects(path, None, max(max_line_bytes, MAX_LINE_BYTES)):
            where = f"{path}:{line}"
            for span in _spans(obj, where):
                if not isinstance(span, dict) or span.get("name") != SPAN:
                    continue
                attrs = _attributes(span, where)
                missing = [k for k in (PROMPT, OUTPUT) if k not in attrs]
                if missing:
                    raise ValueError(f"{where}: an {SPAN} span lacks {missing}; vLLM writes both")
                start = span.get("startTimeUnixNano")
                try:
                    start_ns = int(start)
                except (TypeError, ValueError):
                    raise ValueError(f"{where}: startTimeUnixNano={start!r} is not an integer of nanoseconds") \
                        from None
                rows.append((start_ns, TraceRow(line, _count(attrs[PROMPT], PROMPT, where),
                                                _count(attrs[OUTPUT], OUTPUT, where))))
        rows.sort(key=lambda r: r[0])         # export batches end in any order; arrivals are the spans' starts
        if not rows:
            return []
        first = rows[0][0]
        # relative to the first start in integer ns: the absolute time as a float would round to 0.2 µs
        kept = [TraceRow(r.line, r.prompt_len, r.output_len, arrival_s=(ns - first) * 1e-9) for ns, r in rows]
        return kept if limit is None else kept[:limit]
