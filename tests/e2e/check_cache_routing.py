"""Checks pdgate's cache-aware routing against real vLLM engines (standard library only).

Driven by tests/e2e/vllm_cache_routing.sh, in three phases sharing a state file:

- ``before``: warm-up prompts sent straight to each engine until both gateways' KV-event
  counters show their blocks; then prompts that extend a warm-up prompt (cached on one prefill
  that pdgate never routed to: only its events can tell), two interleaved shared-prefix groups,
  and a chat whose follow-up turn goes through the decode-only gateway. Names the prefill to
  restart (the one holding the second group) in ``STATE.victim``.
- ``down`` (that prefill stopped): both gateways drop it from the routable set, the index loses
  its entries, requests still succeed.
- ``after`` (restarted): it is routable again, its new events reach pdgate, the group it held is
  predicted uncached (no stale entries) and hits again on the next request; then every request's
  output is compared with a plain request to one engine, and predictions are summed up.

Per request through a gateway: status 200; pdgate's ``x-pdgate-predicted-cached-tokens`` equals
the computing engine's ``vllm:prefix_cache_hits_total`` delta and the answer's
``usage.prompt_tokens_details.cached_tokens``; no other prefill computed anything; a two-leg
request moved KV over NIXL without failed transfers. Ends with
``cache_routing: N passed, M failed`` (after the last phase; earlier phases print their own
counts and exit non-zero on a failure).
"""

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

MODEL = "tiny"
HTTP_TIMEOUT_S = 60
MAX_TOKENS = 8
PREDICTED = "x-pdgate-predicted-cached-tokens"
DECODE_ONLY = "x-pdgate-decode-only"
WORDS = (
    "the prefill decode engine cache block token request gateway transfer memory host port "
    "model stream chat completion answer question small fast slow river mountain tree city"
).split()
HITS = "vllm:prefix_cache_hits_total"
PROMPT = "vllm:prompt_tokens_total"
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
NIXL_FAILED = "vllm:nixl_num_failed_transfers_total"
EXTERNAL = "vllm:external_prefix_cache_hits_total"
ENGINE_METRICS = (HITS, PROMPT, NIXL_BYTES, NIXL_FAILED, EXTERNAL)


def words(seed: int, n: int) -> str:
    out, x = [], seed
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(WORDS[x % len(WORDS)])
    return " ".join(out)


class State:
    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path) as f:
                self.d = json.load(f)
        except FileNotFoundError:
            self.d = {"passed": 0, "failed": 0, "records": [], "outputs": [], "groups": {}}

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.d, f)

    def check(self, ok: bool, name: str, detail: str = "") -> bool:
        self.d["passed" if ok else "failed"] += 1
        print(f"PASS {name}" if ok else f"FAIL {name}: {detail}", flush=True)
        return ok


def http(url: str, body: dict | None = None) -> tuple[int, dict, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def prom(url: str) -> list[tuple[str, str, float]]:
    """(name, labels, value) of every sample at `url`/metrics."""
    _, _, text = http(url + "/metrics")
    out = []
    for line in text.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        try:
            out.append((name, labels, float(value)))
        except ValueError:
            continue
    return out


def engine_metrics(url: str) -> dict[str, float]:
    got = dict.fromkeys(ENGINE_METRICS, 0.0)
    for name, _, v in prom(url):
        if name in got:
            got[name] += v
    return got


def gateway_metric(url: str, name: str, *labels: str) -> float:
    return sum(v for n, l, v in prom(url) if n == name and all(x in l for x in labels))


def events(url: str, role: str, what: str) -> float:
    return gateway_metric(url, "pdgate_cache_events", f'role="{role}"', f'what="{what}"')


def ready_prefills(url: str) -> list[str]:
    _, _, body = http(url + "/ready")
    try:
        return json.loads(body).get("prefill", [])
    except ValueError:
        return []


def body_of(req: dict, max_tokens: int = MAX_TOKENS) -> tuple[str, dict]:
    body = {"model": req.get("model", MODEL), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if "messages" in req:
        return "/v1/chat/completions", {**body, "messages": req["messages"]}
    return "/v1/completions", {**body, "prompt": req["prompt"]}


def text_of(answer: dict) -> str | None:
    try:
        c = answer["choices"][0]
        return c["message"]["content"] if "message" in c else c["text"]
    except (KeyError, IndexError, TypeError):
        return None


class Run:
    def __init__(self, args, st: State) -> None:
        self.st = st
        self.bs = args.block_size
        self.gw = args.gateway
        self.gwdo = args.gateway_decode_only
        self.gwnh = args.gateway_no_health
        self.watching = [self.gw, self.gwdo, self.gwnh]  # gateways warm() waits for
        self.engines: dict[str, str] = dict(e.split("=", 1) for e in args.engine)
        self.prefills = [n for n in self.engines if n.startswith("prefill")]
        self.decode = next(n for n in self.engines if n.startswith("decode"))
        self.stopped: set[str] = set()  # engines not running (their counters stand still)

    def tokens(self, req: dict) -> int:
        url = self.engines[self.decode] + "/tokenize"
        body = {"model": MODEL, "add_generation_prompt": True, **req} if "messages" in req else {"model": MODEL, **req}
        _, _, out = http(url, body)
        return len(json.loads(out)["tokens"])

    def direct(self, engine: str, req: dict) -> dict:
        path, body = body_of(req)
        status, _, out = http(self.engines[engine] + path, body)
        if status != 200:
            raise RuntimeError(f"{engine} answered {status}: {out[:200]!r}")
        return json.loads(out)

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {n: engine_metrics(u) if n not in self.stopped else dict.fromkeys(ENGINE_METRICS, 0.0)
                for n, u in self.engines.items()}

    def send(self, name: str, req: dict, gateway: str | None = None, expect_pod: str | None = None,
             decode_only: bool = False) -> dict:
        """One request through a gateway, checked against the engines; returns its record."""
        gw = gateway or self.gw
        n = self.tokens(req)
        before = self.snapshot()
        path, body = body_of(req)
        status, headers, raw = http(gw + path, body)
        answer = json.loads(raw) if raw.startswith(b"{") else {}
        pod = headers.get("prefill-target-pod")
        computing = pod or self.decode
        # Engines count a request's tokens once it finished; the answer may beat the scrape.
        deadline = time.monotonic() + 3
        while True:
            after = self.snapshot()
            if after[computing][PROMPT] > before[computing][PROMPT] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        d = {e: {m: after[e][m] - before[e][m] for m in ENGINE_METRICS} for e in self.engines}
        predicted = headers.get(PREDICTED)
        predicted = int(predicted) if predicted and predicted.isdigit() else None
        usage = answer.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        hits = int(d[computing][HITS])
        rec = {"name": name, "req": req, "pod": pod, "decode_only": headers.get(DECODE_ONLY), "n": n,
               "predicted": predicted, "engine_hits": hits, "usage_cached": cached, "status": status,
               "text": text_of(answer)}
        dd = d[self.decode]
        print(f"  {name}: n={n} prefill={pod} decode-only={rec['decode_only']} predicted={predicted} "
              f"engine_hits={hits} usage_cached={cached} | decode: local hits {dd[HITS]:.0f}, "
              f"external {dd[EXTERNAL]:.0f}, nixl bytes {dd[NIXL_BYTES]:.0f}", flush=True)
        if not self.st.check(status == 200, f"{name}: 200", f"{status} {raw[:300]!r}"):
            return rec
        self.st.d["records"].append(rec)
        self.st.d["outputs"].append([name, req, rec["text"]])
        self.st.check(predicted == hits == cached,
                      f"{name}: predicted cached {predicted} == engine prefix hits {hits} == usage {cached}")
        others = [p for p in self.prefills if p != pod]
        self.st.check(all(d[p][PROMPT] == 0 for p in others),
                      f"{name}: no other prefill computed ({', '.join(others)})",
                      str({p: d[p][PROMPT] for p in others}))
        if decode_only:
            self.st.check(pod is None and rec["decode_only"] is not None,
                          f"{name}: served decode-only ({DECODE_ONLY}: {rec['decode_only']}, no prefill-target-pod)",
                          f"prefill {pod}")
            self.st.check(dd[NIXL_BYTES] == 0 and hits > 0,
                          f"{name}: the decode computed it from its own cache ({hits} hits, no NIXL bytes)",
                          f"nixl bytes {dd[NIXL_BYTES]}")
        else:
            self.st.check(pod is not None and dd[NIXL_BYTES] > 0 and dd[NIXL_FAILED] == 0,
                          f"{name}: two legs, KV pulled over NIXL", f"prefill {pod}, decode deltas {dd}")
        if expect_pod is not None:
            self.st.check(pod == expect_pod, f"{name}: routed to {expect_pod}, which holds its prefix",
                          f"went to {pod}")
        return rec

    def wait_events(self, role: str, at_least: float, base: dict[str, float]) -> bool:
        """Until the gateways in `base` counted `at_least` more stored blocks for `role` than there."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if all(events(g, role, "blocks_stored") - b >= at_least for g, b in base.items()):
                return True
            time.sleep(0.2)
        return False

    def warm(self, engine: str, seed: int) -> tuple[dict, bool]:
        """A prompt sent straight to `engine` until the watching gateways saw its blocks stored
        (for the decode, those that read its events: a gateway whose decode is chosen by load
        alone does not subscribe to them)."""
        role = "decode" if engine == self.decode else "prefill"
        watching = [self.gwdo] if role == "decode" else self.watching
        for attempt in range(5):
            req = {"prompt": words(seed + attempt, 4 * self.bs)}
            full = self.tokens(req) // self.bs
            base = {g: events(g, role, "blocks_stored") for g in watching}
            self.direct(engine, req)
            if self.wait_events(role, full, base):
                return req, True
        return req, False

    def sequence_restart(self, victim: str, first_warm: dict) -> None:
        """The gateway that never dropped the victim follows its restart on the same subscription."""
        st = self.st
        deadline = time.monotonic() + 60
        i = 0
        flowing = False
        while time.monotonic() < deadline and not flowing:
            req = {"prompt": words(6000 + i, 3 * self.bs)}
            full = self.tokens(req) // self.bs
            base = events(self.gwnh, "prefill", "blocks_stored")
            self.direct(victim, req)
            i += 1
            end = time.monotonic() + 3
            while time.monotonic() < end and not flowing:
                flowing = events(self.gwnh, "prefill", "blocks_stored") - base >= full
                time.sleep(0.2)
        what = ", ".join(f"{w} {events(self.gwnh, 'prefill', w):.0f}" for w in ("clears", "replays", "restarts", "gaps"))
        st.check(flowing, f"the gateway without health checks hears the restarted {victim} again "
                 f"(after {i} prompts; its prefill event counters: {what})")
        # What the engine stored first after its restart, perhaps before that gateway was back,
        # is known there too (from the replay).
        self.send("extends-first-prompt-after-restart-no-health", {"prompt": first_warm["prompt"] + " " + words(420, 12)},
                  gateway=self.gwnh, expect_pod=victim)

    # ---- phases ----------------------------------------------------------------------------
    def before(self) -> None:
        st = self.st
        warm = {}
        for i, e in enumerate(self.engines):
            warm[e], ok = self.warm(e, 1000 + 100 * i)
            st.check(ok, f"the gateways received {e}'s KV events for a prompt sent to it directly")
        st.d["warm"] = {e: r["prompt"] for e, r in warm.items()}
        # Only the events tell pdgate where these prefixes are: it never routed them.
        for i, p in enumerate(self.prefills):
            req = {"prompt": warm[p]["prompt"] + " " + words(2000 + i, 12)}
            self.send(f"extends-{p}-warmup", req, expect_pod=p)
        # Two shared-prefix groups, interleaved: each lands where its first request went.
        prefix = {"A": words(10, 220), "B": words(11, 220)}
        first: dict[str, str | None] = {}
        for k in range(3):
            for g in ("A", "B"):
                rec = self.send(f"group{g}-{k}", {"prompt": prefix[g] + " " + words(100 + 10 * k + ord(g), 20)},
                                expect_pod=first.get(g))
                first.setdefault(g, rec["pod"])
                if k > 0:
                    st.check(rec["engine_hits"] >= self.tokens({"prompt": prefix[g]}) // self.bs * self.bs - self.bs,
                             f"group{g}-{k}: the shared prefix was a prefix-cache hit on {rec['pod']}",
                             f"{rec['engine_hits']} hits")
        st.d["groups"] = {"prefix": prefix, "pod": first}
        # A chat through both legs, then its follow-up turn served by the decode alone.
        chat = [{"role": "system", "content": words(30, 90)}, {"role": "user", "content": words(31, 40)}]
        turn1 = self.send("chat-turn1", {"messages": chat})
        follow = chat + [{"role": "assistant", "content": turn1["text"] or ""},
                         {"role": "user", "content": words(32, 20)}]
        self.send("chat-turn2-decode-only", {"messages": follow}, gateway=self.gwdo, decode_only=True)
        st.d["victim"] = first["B"]
        st.d["index_before"] = gateway_metric(self.gw, "pdgate_cache_index_entries", f'model="{MODEL}"')
        with open(st.path + ".victim", "w") as f:
            f.write(first["B"] or self.prefills[-1])

    def lora(self, lora_dir: str) -> None:
        """LoRA adapters (vllm_cache_routing.sh: prefill1 serves a and b, prefill2 b, the decode
        both): requests reach only prefills serving their adapter, predictions equal the engines'
        hits per adapter (vLLM salts an adapter's block hashes with its name and its KV events
        carry ``lora_name``), affinity holds within an adapter and never across, an unknown
        adapter is refused by pdgate itself, and an adapter loaded or unloaded at run time is
        learned from the engines' /v1/models."""
        st = self.st
        holders = {"a": ["prefill1"], "b": ["prefill1", "prefill2"]}
        for adapter, pods in holders.items():
            # Three questions on one shared prefix: the later ones hit where the first went.
            prefix = words(7000 + ord(adapter), 3 * self.bs)
            first = None
            for k in range(3):
                req = {"model": adapter, "prompt": prefix + " " + words(7050 + 10 * k + ord(adapter), 12)}
                rec = self.send(f"lora-{adapter}-{k}", req, expect_pod=first)
                first = first or rec["pod"]
                st.check(rec["pod"] in pods, f"lora-{adapter}-{k}: prefill serves {adapter} ({', '.join(pods)})",
                         f"went to {rec['pod']}")
                if k > 0:
                    st.check(rec["engine_hits"] > 0, f"lora-{adapter}-{k}: the adapter's shared prefix was a hit",
                             f"{rec['engine_hits']} hits")
        # A prompt cached under adapter b on prefill2, told to pdgate only by its events.
        warm = {"model": "b", "prompt": words(7100, 4 * self.bs)}
        full = self.tokens(warm) // self.bs
        base = {g: events(g, "prefill", "blocks_stored") for g in self.watching}
        self.direct("prefill2", warm)
        st.check(self.wait_events("prefill", full, base),
                 "the gateways received prefill2's KV events for an adapter's prompt")
        ext = warm["prompt"] + " " + words(7101, 12)
        rec = self.send("lora-b-extends-prefill2-warmup", {"model": "b", "prompt": ext}, expect_pod="prefill2")
        st.check(rec["engine_hits"] > 0, "the adapter's prefix was a hit where its events said",
                 f"{rec['engine_hits']} hits")
        for model in (MODEL, "a"):
            req = {"prompt": ext} if model == MODEL else {"model": model, "prompt": ext}
            rec = self.send(f"{model}-same-prompt-as-lora-b", req)
            st.check(rec["predicted"] == 0 and rec["engine_hits"] == 0,
                     f"{model}: adapter b's blocks are no hit under another model",
                     f"predicted {rec['predicted']}, engine hits {rec['engine_hits']}")
        # An adapter no engine serves: pdgate answers, no engine computes.
        before = self.snapshot()
        status, _, raw = http(self.gw + "/v1/completions", {"model": "nosuch", "prompt": "hi", "max_tokens": 1})
        after = self.snapshot()
        err = json.loads(raw).get("error", {}) if raw.startswith(b"{") else {}
        st.check(status == 404 and bool(err.get("message")),
                 "an unknown model or adapter is a 404 with an OpenAI error", f"{status} {raw[:200]!r}")
        st.check(all(after[e][PROMPT] == before[e][PROMPT] for e in self.engines),
                 "no engine saw the request for an unknown adapter")
        # Adapter c loaded at run time on prefill2 and the decode, then unloaded from both: the
        # gateway's /v1/models (the fleet's adapters, learned on its health rounds) follows.
        for e in ("prefill2", self.decode):
            status, _, raw = http(self.engines[e] + "/v1/load_lora_adapter",
                                  {"lora_name": "c", "lora_path": f"{lora_dir}/lora-c"})
            st.check(status == 200, f"{e} loaded adapter c at run time", f"{status} {raw[:200]!r}")
        learned = self.until_listed("c", True)
        st.check(learned is not None, f"the gateway lists adapter c after it was loaded ({learned} s)")
        if learned is not None:
            req = {"model": "c", "prompt": words(7200, 3 * self.bs)}
            self.send("lora-c-loaded-at-run-time", req, expect_pod="prefill2")
            # Compared now: c is gone from the decode by the end of the run.
            name, req, text = st.d["outputs"].pop()
            want = text_of(self.direct(self.decode, req))
            st.check(text == want, f"{name}: output equals a plain request to {self.decode}", f"{text!r} vs {want!r}")
        for e in ("prefill2", self.decode):
            status, _, raw = http(self.engines[e] + "/v1/unload_lora_adapter", {"lora_name": "c"})
            st.check(status == 200, f"{e} unloaded adapter c", f"{status} {raw[:200]!r}")
        gone = self.until_listed("c", False)
        st.check(gone is not None, f"the gateway drops adapter c once no engine serves it ({gone} s)")
        status, _, raw = http(self.gw + "/v1/completions", {"model": "c", "prompt": "hi", "max_tokens": 1})
        st.check(status == 404, "then a request for c is a 404", f"{status} {raw[:200]!r}")
        st.d["index_before"] = gateway_metric(self.gw, "pdgate_cache_index_entries", f'model="{MODEL}"')

    def until_listed(self, adapter: str, listed: bool, within: float = 15.0) -> float | None:
        """Seconds until the gateway's /v1/models lists `adapter` (or no longer does); None: never."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < within:
            _, _, raw = http(self.gw + "/v1/models")
            try:
                ids = {card["id"] for card in json.loads(raw)["data"]}
            except (ValueError, KeyError, TypeError):
                ids = set()
            if (adapter in ids) == listed:
                return round(time.monotonic() - t0, 1)
            time.sleep(0.2)
        return None

    def down(self, victim: str) -> None:
        st = self.st
        self.stopped.add(victim)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(victim in ready_prefills(g) for g in (self.gw, self.gwdo)):
            time.sleep(0.5)
        st.check(all(victim not in ready_prefills(g) for g in (self.gw, self.gwdo)),
                 f"both gateways dropped the stopped {victim} from the routable prefills")
        entries = gateway_metric(self.gw, "pdgate_cache_index_entries", f'model="{MODEL}"')
        st.check(entries < st.d["index_before"],
                 f"the index lost {victim}'s entries ({st.d['index_before']:.0f} -> {entries:.0f})")
        survivor = next(p for p in self.prefills if p != victim)
        self.send("groupB-while-down", {"prompt": st.d["groups"]["prefix"]["B"] + " " + words(300, 20)},
                  expect_pod=survivor)

    def after(self, victim: str) -> None:
        st = self.st
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(victim in ready_prefills(g) for g in (self.gw, self.gwdo)):
            time.sleep(0.5)
        st.check(all(victim in ready_prefills(g) for g in (self.gw, self.gwdo)),
                 f"the restarted {victim} is routable again on both gateways")
        # The gateway without health checks kept its subscription; it may reconnect later (its
        # socket retries with a backoff of up to 30 s), so it is left out here and checked below.
        self.watching = [self.gw, self.gwdo]
        first_warm, ok = self.warm(victim, 5000)
        st.check(ok, f"both health-checked gateways receive the restarted {victim}'s KV events")
        print(f"  gateway events after the restart: prefill restarts {events(self.gw, 'prefill', 'restarts'):.0f}, "
              f"replays {events(self.gw, 'prefill', 'replays'):.0f}, gaps {events(self.gw, 'prefill', 'gaps'):.0f}",
              flush=True)
        # The victim held this warm-up prompt before its restart: a stale entry would predict a
        # hit the engine no longer has. Predicted uncached, then cached again where it went.
        warm = st.d["warm"][victim]
        v = self.send(f"extends-{victim}-warmup-after-restart", {"prompt": warm + " " + words(410, 12)})
        st.check(v["predicted"] == 0, f"no stale prediction for the restarted {victim}'s old blocks",
                 f"predicted {v['predicted']} on {v['pod']}")
        v2 = self.send(f"extends-{victim}-warmup-after-restart-2", {"prompt": warm + " " + words(411, 12)},
                       expect_pod=v["pod"])
        st.check(v2["engine_hits"] > 0, "that prefix hits again after the restart", f"{v2['engine_hits']} hits")
        prefix = st.d["groups"]["prefix"]
        survivor = next(p for p in self.prefills if p != victim)
        # Group B, cached on the survivor by the request made while the victim was down.
        self.send("groupB-after-restart", {"prompt": prefix["B"] + " " + words(400, 20)}, expect_pod=survivor)
        a_pod = st.d["groups"]["pod"]["A"]
        if a_pod != victim:
            self.send("groupA-after-restart", {"prompt": prefix["A"] + " " + words(402, 20)}, expect_pod=a_pod)
        # A fresh group after the restart: the restarted engine, caching least, takes it (ties go to
        # the endpoint with fewer index entries), and its next request hits there.
        c = {"prompt": words(12, 220) + " " + words(403, 20)}
        c_pod = self.send("groupC-0", c, expect_pod=victim)["pod"]
        self.send("groupC-1", {"prompt": words(12, 220) + " " + words(404, 20)}, expect_pod=c_pod)
        self.sequence_restart(victim, first_warm)
        # Outputs equal a plain (non-PD) request to one engine, greedy (adapters' on the decode,
        # which serves them all).
        base_engine = next(p for p in self.prefills if p != victim)
        same = 0
        for name, req, text in st.d["outputs"]:
            engine = base_engine if "model" not in req else self.decode
            want = text_of(self.direct(engine, req))
            same += st.check(text == want, f"{name}: output equals a plain request to {engine}",
                             f"{text!r} vs {want!r}")
        recs = st.d["records"]
        exact = sum(1 for r in recs if r["predicted"] == r["engine_hits"] == r["usage_cached"])
        share = exact / len(recs) if recs else 0.0
        st.check(share >= 0.99, f"predicted cached tokens exact on {exact}/{len(recs)} requests ({share:.1%})")
        print(f"  requests: {len(recs)} through pdgate, {sum(1 for r in recs if r['decode_only'])} decode-only, "
              f"{sum(r['engine_hits'] for r in recs)} prompt tokens hit of {sum(r['n'] for r in recs)}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state", required=True)
    ap.add_argument("--phase", choices=("before", "lora", "down", "after"), required=True)
    ap.add_argument("--victim")
    ap.add_argument("--lora-dir", help="where lora-c (the adapter loaded at run time) is")
    ap.add_argument("--gateway", required=True)
    ap.add_argument("--gateway-decode-only", required=True)
    ap.add_argument("--gateway-no-health", required=True)
    ap.add_argument("--engine", action="append", required=True, help="NAME=URL (prefill*, decode*)")
    ap.add_argument("--block-size", type=int, default=32)
    args = ap.parse_args()
    st = State(args.state)
    failed = st.d["failed"]
    run = Run(args, st)
    try:
        if args.phase == "before":
            run.before()
        elif args.phase == "lora":
            run.lora(args.lora_dir)
        elif args.phase == "down":
            run.down(args.victim)
        else:
            run.after(args.victim)
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        st.check(False, f"phase {args.phase} ran to its end", repr(e))
    st.save()
    if args.phase == "after":
        print(f"cache_routing: {st.d['passed']} passed, {st.d['failed']} failed", flush=True)
        return 0 if st.d["failed"] == 0 else 1
    print(f"phase {args.phase}: {st.d['failed'] - failed} failed", flush=True)
    return 0 if st.d["failed"] == failed else 1


if __name__ == "__main__":
    sys.exit(main())
