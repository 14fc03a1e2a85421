"""The baselines `ridge bench` measures ridge against, on the same workload:

- HF transformers `generate`: static batches of `in_flight`, fp32, the same GGUF
  loaded by transformers, left padding, exact lengths (min_new_tokens =
  max_new_tokens = the batch's longest target); only each request's own target
  counts as useful output.
- any HTTP server speaking llama-server's `/completion` or the OpenAI
  `/v1/completions` API: `in_flight` closed-loop client threads, the
  chat-formatted prompt text, n_predict / max_tokens = the target, ignore_eos,
  streamed so that TTFT and inter-token latency are seen by the client."""
from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import torch

from .runs import Rec, _summary
from .workloads import Workload

# -- HF transformers ------------------------------------------------------------------------


def load_hf_model(model_path: Path):
    """transformers' own GGUF loader, dequantized to fp32."""
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    if model_path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                     dtype=torch.float32)
    model.eval()
    return model, time.perf_counter() - t


def run_hf(model, wl: Workload, in_flight: int, pad_id: int) -> dict:
    from transformers import LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):  # called once per generated position, right after its forward
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def generate(idx: list[int], longest: int) -> list[float]:
        prompts = [wl.prompt_ids[i] for i in idx]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        clock = Clock()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                 do_sample=False, pad_token_id=pad_id, logits_processor=LogitsProcessorList([clock]))
        if out.shape[1] - width != longest:
            raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, asked for {longest}")
        return clock.times

    generate([0], 4)  # warm-up
    recs: list[Rec] = []
    steps = 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    for b in range(0, wl.num_requests, in_flight):
        idx = list(range(b, min(b + in_flight, wl.num_requests)))
        longest = max(wl.lengths[i] for i in idx)
        submit = time.perf_counter()
        times = generate(idx, longest)
        steps += len(times)
        recs += [Rec(i, wl.lengths[i], submit, list(times)) for i in idx]
    return _summary("hf-static", recs, t0, time.perf_counter(), steps, in_flight, cpu0)


# -- HTTP servers -----------------------------------------------------------------------------


def _payload(api: str, text: str, n: int, model_name: str | None) -> tuple[str, dict]:
    if api == "llama":
        return "/completion", {"prompt": text, "n_predict": n, "ignore_eos": True, "temperature": 0.0,
                               "stream": True, "cache_prompt": True}
    body = {"prompt": text, "max_tokens": n, "min_tokens": n, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if model_name:
        body["model"] = model_name
    return "/v1/completions", body


def _read_stream(resp, api: str, rec: Rec) -> int | None:
    """Consume the SSE stream, stamping each token event; -> the server's token count."""
    reported = None
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        now = time.perf_counter()
        if api == "llama":
            if ev.get("stop"):
                reported = ev.get("tokens_predicted", reported)
                if ev.get("content"):
                    rec.times.append(now)
                break
            rec.times.append(now)
        else:
            if ev.get("usage"):
                reported = ev["usage"].get("completion_tokens", reported)
            ch = ev.get("choices") or []
            if ch and (ch[0].get("text") or not ch[0].get("finish_reason")):
                rec.times.append(now)
    resp.read()  # drain, so the connection can be reused
    return reported


def run_server(url: str, api: str, wl: Workload, texts: list[str], in_flight: int,
               model_name: str | None = None, timeout: float = 600.0) -> dict:
    u = urlparse(url if "://" in url else f"http://{url}")
    host, port = u.hostname or "127.0.0.1", u.port or 80
    n = wl.num_requests
    recs: list[Rec | None] = [None] * n
    lock = threading.Lock()
    counter = iter(range(n))
    mismatches = []

    def one(i: int, length: int | None = None) -> None:
        length = length or wl.lengths[i]
        path, body = _payload(api, texts[i], length, model_name)
        rec = recs[i] = Rec(i, length, time.perf_counter())
        conn = http.client.HTTPConnection(host, port, timeout=timeout)  # one per request: no keep-alive races
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
                return
            reported = _read_stream(resp, api, rec)
        except (OSError, http.client.HTTPException, ValueError) as e:
            rec.error = f"{type(e).__name__}: {e}"
            return
        finally:
            conn.close()
        if reported is not None and reported != len(rec.times):
            # Events are not always one per token (held-back text); trust the server's count.
            if len(rec.times) > reported:
                del rec.times[reported:]
            else:
                rec.times += [rec.times[-1] if rec.times else time.perf_counter()] * (reported - len(rec.times))
        if len(rec.times) != rec.target:
            with lock:
                mismatches.append((i, rec.target, len(rec.times)))

    def client() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            one(i)

    # Warm-up (not timed): a fresh server pays first-use costs (page-in of a mmapped model,
    # graph and buffer set-up) on its first requests; the engine side is warmed up too.
    one(0, 8)
    if recs[0].error:
        raise RuntimeError(f"the server at {url} failed its first request: {recs[0].error}")
    recs[0] = None
    mismatches.clear()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(min(in_flight, n))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = _summary(f"server-{api}", [r for r in recs if r is not None], t0, time.perf_counter(), 0, in_flight)
    out["url"], out["length_mismatches"] = url, mismatches[:10]
    return out


# CPU counters an OpenAI-style server may export on /metrics (ridge's gateway exports all three)
CPU_METRICS = {"ridge:gateway_cpu_seconds_total": "gateway_s",
               "ridge:daemon_socket_thread_cpu_seconds_total": "daemon_socket_thread_s",
               "process_cpu_seconds_total": "process_s"}


def server_cpu(url: str) -> dict:
    """The server's CPU seconds so far, from its Prometheus /metrics (best effort: {} without)."""
    from prometheus_client.parser import text_string_to_metric_families

    u = urlparse(url if "://" in url else f"http://{url}")
    try:
        conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=10)
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        text = resp.read().decode() if resp.status == 200 else ""
        conn.close()
        families = list(text_string_to_metric_families(text))
    except (OSError, http.client.HTTPException, ValueError):
        return {}
    return {CPU_METRICS[s.name]: s.value for f in families for s in f.samples if s.name in CPU_METRICS}


def cpu_used(before: dict, after: dict, wall_s: float) -> dict:
    """CPU seconds each counter moved over a run, and as cores (seconds per wall second)."""
    out = {k: after[k] - before[k] for k in after if k in before}
    out.update({k.removesuffix("_s") + "_cores": v / wall_s for k, v in list(out.items()) if wall_s > 0})
    return out


def server_info(url: str, api: str) -> dict:
    """What the server says about itself (llama-server: /props), best effort."""
    u = urlparse(url if "://" in url else f"http://{url}")
    try:
        conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=10)
        conn.request("GET", "/props" if api == "llama" else "/v1/models")
        resp = conn.getresponse()
        info = json.loads(resp.read()) if resp.status == 200 else {}
        conn.close()
    except (OSError, http.client.HTTPException, ValueError):
        return {}
    if api == "llama":
        keep = ("total_slots", "model_path", "build_info")
        return {k: info.get(k) for k in keep if k in info} | {
            "n_ctx": (info.get("default_generation_settings") or {}).get("n_ctx")}
    return {"models": [m.get("id") for m in info.get("data", [])]}
