"""Multi-host rehearsal on one machine: every learner on its own "host" (a network namespace)
behind its own rate-limited link, the stable part (Redis, broker, syncer shards) on the root
namespace, then one learner's link cut and healed.

    sudo .venv/bin/python -m ddloco.bench.multihost                       # 4 learners: 1G, 1G, 100M, 100M
    sudo .venv/bin/python -m ddloco.bench.multihost --rates 1gbit,100mbit --delay-ms 25 --minutes 3

What it builds (Linux, root; iproute2's `ip` and `tc`):
- a bridge ``ddlbr0`` (10.77.0.1/24) in the root namespace; the syncers, the broker and Redis
  listen there;
- per learner i: namespace ``ddl-l<i>`` with ``eth0`` = 10.77.0.<10+i>, a veth pair to the bridge,
  and a ``tc tbf`` rate limit in both directions (the root-side end shapes the downlink, the
  namespace end the uplink);
- delay: ``netem`` is not available everywhere (not in this project's sandbox), so one-way delay
  is added in user space by a TCP relay in front of the broker (``--delay-ms`` each way; every
  chunk is held until its time, order kept); Redis and the shards' RPC are reached directly.

What it measures (``--json FILE`` writes it all):
- per learner: bytes up and down on its link (the veth's counters) as a mean rate over the run and
  the peak over 1 s windows, against its link rate;
- the cut: ``ip link set <veth> down`` for ``--cut-s`` seconds on learner 0; when membership
  drops it (detection), that merges go on meanwhile (largest gap between merges), and after the
  heal, when it is back in membership and when its first answer after the heal is merged
  (rejoin): the learner is not restarted, it finds its way back on its own.
The namespaces, links and processes are removed at the end (also on Ctrl-C or an error).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from common import control
from common.exits import FAILURE, OK, USAGE
from common.keys import Keys
from common.lifecycle import stop_processes
from common.redis_server import EmbeddedRedis, free_port
from ddloco.waiting import wait_for

BRIDGE, SUBNET = "ddlbr0", "10.77.0"
HOST_IP = f"{SUBNET}.1"
RUN_ID = "multihost"


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(argv), capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip()}")
    return res


def rate_bits(rate: str) -> float:
    """'1gbit' / '100mbit' / '500kbit' -> bits per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, mult in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * mult
    raise ValueError(f"rate {rate!r}: use e.g. 1gbit, 100mbit, 500kbit")


class Topology:
    """The bridge, one namespace + shaped veth pair per learner; removed by ``teardown``."""

    def __init__(self, rates: list[str]) -> None:
        self.rates = rates

    def ns(self, i: int) -> str:
        return f"ddl-l{i}"

    def veth(self, i: int) -> str:
        return f"ddlv{i}"

    def ip(self, i: int) -> str:
        return f"{SUBNET}.{10 + i}"

    def create(self) -> None:
        self.teardown()  # leftovers of an interrupted run
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")
        for i, rate in enumerate(self.rates):
            ns, veth = self.ns(i), self.veth(i)
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            sh("ip", "link", "set", f"{veth}p", "netns", ns)
            sh("ip", "link", "set", veth, "master", BRIDGE, "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", f"{veth}p", "name", "eth0")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            sh("ip", "netns", "exec", ns, "ip", "route", "add", "default", "via", HOST_IP)
            burst = str(max(32_000, int(rate_bits(rate) / 8 / 250)))   # ~4 ms of traffic
            shape = ["root", "tbf", "rate", rate, "burst", burst, "latency", "50ms"]
            sh("tc", "qdisc", "add", "dev", veth, *shape)                             # downlink
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", *shape)  # uplink

    def teardown(self) -> None:
        for ns in sh("ip", "netns", "list", check=False).stdout.split("\n"):
            name = ns.split(" ")[0]
            if name.startswith("ddl-l"):
                subprocess.run(["ip", "netns", "pids", name], capture_output=True)
                sh("ip", "netns", "del", name, check=False)
        sh("ip", "link", "del", BRIDGE, check=False)

    def counters(self, i: int) -> tuple[int, int]:
        """(bytes up from the learner, bytes down to it) on its link, read on the root side."""
        base = Path("/sys/class/net") / self.veth(i) / "statistics"
        return int((base / "rx_bytes").read_text()), int((base / "tx_bytes").read_text())

    def cut(self, i: int) -> None:
        sh("ip", "link", "set", self.veth(i), "down")

    def heal(self, i: int) -> None:
        sh("ip", "link", "set", self.veth(i), "up")


class DelayRelay:
    """A TCP relay that holds every chunk ``delay_s`` before passing it on (one way), in its own
    thread and event loop: the user-space stand-in for ``netem delay``."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay_s: float) -> None:
        self.listen, self.target, self.delay_s = listen, target, delay_s
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"relay-{listen[1]}", daemon=True)

    def start(self) -> DelayRelay:
        self.thread.start()
        self.ready.wait(10)
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._client, *self.listen))
        self.ready.set()
        try:
            self.loop.run_forever()
        finally:
            server.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer), return_exceptions=True)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                if not chunk:
                    break
                wait = due - self.loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)   # the emulated propagation delay itself
                dst.write(chunk)
                await dst.drain()
        task = asyncio.ensure_future(deliver())
        try:
            while True:
                chunk = await src.read(1 << 16)
                await queue.put((self.loop.time() + self.delay_s, chunk))
                if not chunk:
                    break
            await task
        finally:
            task.cancel()
            dst.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ddloco.bench.multihost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1gbit,1gbit,100mbit,100mbit",
                    help="one link rate per learner (tc syntax; default 1gbit,1gbit,100mbit,100mbit)")
    ap.add_argument("--delay-ms", type=float, default=25.0, help="one-way delay to the broker (default 25)")
    ap.add_argument("--syncers", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=3.0, help="length of the run (default 3)")
    ap.add_argument("--cut-at", type=float, default=60.0, help="cut learner 0's link this many seconds after "
                    "every learner contributed (default 60)")
    ap.add_argument("--cut-s", type=float, default=20.0, help="how long the link stays down (default 20)")
    ap.add_argument("--step-time-floor-ms", type=float, default=50.0)
    ap.add_argument("--json", metavar="FILE", help="write every figure here")
    return ap.parse_args(list(argv))


class _Rehearsal:
    """One rehearsal: the cluster on the namespaces' links, the measurement, the figures (one
    thread; a SIGTERM only sets ``stop``)."""

    def __init__(self, args: argparse.Namespace, rates: list[str], topo: Topology, work: Path) -> None:
        self.args, self.rates, self.topo, self.work = args, rates, topo, work
        self.lids = [f"l{i}" for i in range(len(rates))]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.relays: list[DelayRelay] = []
        self.stop = threading.Event()
        self.result: dict[str, Any] = {"rates": rates, "delay_ms_one_way": args.delay_ms, "learners": {}}
        self.keys = Keys(RUN_ID)

    def start(self, redis_srv: EmbeddedRedis) -> None:
        """The broker (behind the delay relays), the shards, one learner per namespace."""
        args, topo, work = self.args, self.topo, self.work
        pub, sub = free_port(HOST_IP), free_port(HOST_IP)
        pub_d, sub_d = free_port(HOST_IP), free_port(HOST_IP)
        for listen, target in (((HOST_IP, pub_d), (HOST_IP, pub)), ((HOST_IP, sub_d), (HOST_IP, sub))):
            self.relays.append(DelayRelay(listen, target, args.delay_ms / 1000).start())
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "DDLOCO_KEYS": str(work / "keys"),
               "DDLOCO_REDIS_URL": redis_srv.url}
        common = ["--run-id", RUN_ID, "--log-format", "json"]

        def start(name: str, argv: list[str]) -> None:
            log = open(work / f"{name}.log", "ab")
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                stdin=subprocess.DEVNULL)
        ddl = [sys.executable, "-m", "ddloco"]
        start("broker", [*ddl, "broker", *common, "--xsub", f"tcp://{HOST_IP}:{pub}",
                         "--xpub", f"tcp://{HOST_IP}:{sub}"])
        for k in range(args.syncers):
            start(f"syncer{k}", [*ddl, "syncer", *common, "--broker-pub", f"tcp://{HOST_IP}:{pub}",
                                 "--broker-sub", f"tcp://{HOST_IP}:{sub}", "--shard", str(k), "--shards",
                                 str(args.syncers), "--rpc-bind", f"tcp://{HOST_IP}:0",
                                 "--checkpoint-dir", str(work / "ck")])
        for i, lid in enumerate(self.lids):
            start(lid, ["ip", "netns", "exec", topo.ns(i), *ddl, "learner", *common,
                        "--broker-pub", f"tcp://{HOST_IP}:{pub_d}", "--broker-sub", f"tcp://{HOST_IP}:{sub_d}",
                        "--learner-id", lid, "--data-shard", str(i), "--peer-bind", "tcp://0.0.0.0:7100",
                        "--advertise-host", topo.ip(i), "--step-time-floor-ms", str(args.step_time_floor_ms)])
        self.r = control.connect(redis_srv.url)

    def merged(self, lid: str) -> int:
        return int(self.r.hget(self.keys.learner(lid), "merged_contributions") or 0)

    def _cut_step(self, cut: dict[str, Any], now: float, t0: float, live: dict[str, Any]) -> None:
        """The cut's next event, if due: cut, detected, healed, back in membership, merged again."""
        args, cut_lid = self.args, self.lids[0]
        if "cut_t" not in cut and now - t0 >= args.cut_at:
            self.topo.cut(0)
            cut["cut_t"] = now
            print(f"+{now - t0:.0f} s: cut {cut_lid}'s link", flush=True)
        elif "cut_t" in cut and "detect_s" not in cut and cut_lid not in live:
            cut["detect_s"] = round(now - cut["cut_t"], 2)
            print(f"+{now - t0:.0f} s: membership dropped {cut_lid} ({cut['detect_s']} s after the cut)",
                  flush=True)
        elif "cut_t" in cut and "heal_t" not in cut and now - cut["cut_t"] >= args.cut_s:
            self.topo.heal(0)
            cut["heal_t"] = now
            cut["merged_at_heal"] = self.merged(cut_lid)
            print(f"+{now - t0:.0f} s: healed {cut_lid}'s link", flush=True)
        elif "heal_t" in cut and "back_in_membership_s" not in cut and cut_lid in live:
            cut["back_in_membership_s"] = round(now - cut["heal_t"], 2)
        elif "heal_t" in cut and "rejoin_s" not in cut and self.merged(cut_lid) > cut["merged_at_heal"]:
            cut["rejoin_s"] = round(now - cut["heal_t"], 2)
            print(f"+{now - t0:.0f} s: {cut_lid} contributes again ({cut['rejoin_s']} s after the heal, "
                  "not restarted)", flush=True)

    def measure(self) -> None:
        """Once every learner contributes: link counters and merges every 0.5 s, the cut and heal."""
        args, r, keys, n = self.args, self.r, self.keys, len(self.rates)
        wait_for(lambda: all(self.merged(lid) > 0 for lid in self.lids), 600, "every learner contributing", 0.5)
        t0 = time.monotonic()
        samples: list[tuple[float, list[tuple[int, int]]]] = [(t0, [self.topo.counters(i) for i in range(n)])]
        cut: dict[str, Any] = {}
        end = t0 + args.minutes * 60
        merge_times: list[float] = []
        seen_merges = len(control.read_events(r, keys, kind="merge"))
        print(f"every learner contributing; measuring for {args.minutes:.1f} min, cutting {self.lids[0]}'s link at "
              f"+{args.cut_at:.0f} s for {args.cut_s:.0f} s", flush=True)
        while time.monotonic() < end and not self.stop.is_set():
            now = time.monotonic()
            samples.append((now, [self.topo.counters(i) for i in range(n)]))
            merges = control.read_events(r, keys, kind="merge")
            merge_times += [now] * (len(merges) - seen_merges)
            seen_merges = len(merges)
            self._cut_step(cut, now, t0, control.live_learners(r, keys))
            self.stop.wait(0.5)
        t_end = time.monotonic()
        during = [t for t in merge_times if cut.get("cut_t", 0) <= t <= cut.get("heal_t", 0)]
        cut["merges_while_cut"] = len(during)
        gaps = [b - a for a, b in zip(merge_times, merge_times[1:])]
        cut["largest_merge_gap_s"] = round(max(gaps), 2) if gaps else None
        cut["restarted"] = self.procs[self.lids[0]].poll() is not None
        self.result["cut"] = {k: v for k, v in cut.items() if not k.endswith("_t")}
        self._link_figures(samples, t0, t_end)
        self.result["seconds"] = round(t_end - t0, 1)

    def _link_figures(self, samples: list[tuple[float, list[tuple[int, int]]]], t0: float, t_end: float) -> None:
        """Per learner: mean and peak (~1 s windows) rates up and down, against its link."""
        start_counts = samples[0][1]
        for i, lid in enumerate(self.lids):
            up = (samples[-1][1][i][0] - start_counts[i][0]) * 8 / (t_end - t0)
            down = (samples[-1][1][i][1] - start_counts[i][1]) * 8 / (t_end - t0)
            peak_up = peak_down = 0.0
            for (ta, ca), (tb, cb) in zip(samples, samples[2:]):   # ~1 s windows
                peak_up = max(peak_up, (cb[i][0] - ca[i][0]) * 8 / (tb - ta))
                peak_down = max(peak_down, (cb[i][1] - ca[i][1]) * 8 / (tb - ta))
            h = self.r.hgetall(self.keys.learner(lid))
            link = rate_bits(self.rates[i])
            self.result["learners"][lid] = {
                "link": self.rates[i], "up_mbit_s": round(up / 1e6, 3), "down_mbit_s": round(down / 1e6, 3),
                "peak_up_mbit_s": round(peak_up / 1e6, 2), "peak_down_mbit_s": round(peak_down / 1e6, 2),
                "up_of_link": round(up / link, 5), "down_of_link": round(down / link, 5),
                "peak_of_link": round(max(peak_up, peak_down) / link, 4),
                "steps": int(float(h.get("steps", 0))), "merged_contributions": int(h.get("merged_contributions", 0))}

    def close(self) -> None:
        stop_processes(self.procs.values())
        for relay in self.relays:
            relay.stop()
        self.topo.teardown()


def _print_result(result: dict[str, Any], rates: list[str], args: argparse.Namespace) -> None:
    print(f"\nover {result.get('seconds')} s ({len(rates)} learners, {args.delay_ms:.0f} ms one-way to the broker):")
    print(f"{'learner':<8} {'link':>8} {'up Mbit/s':>10} {'down Mbit/s':>12} {'peak (1 s)':>11} {'peak/link':>10} {'merged':>7}")
    for lid, m in result["learners"].items():
        print(f"{lid:<8} {m['link']:>8} {m['up_mbit_s']:>10.2f} {m['down_mbit_s']:>12.2f} "
              f"{max(m['peak_up_mbit_s'], m['peak_down_mbit_s']):>11.1f} {m['peak_of_link']:>10.3f} "
              f"{m['merged_contributions']:>7}")
    print("cut: " + json.dumps(result.get("cut", {})))


def main(argv: Sequence[str]) -> int:
    args = _parse(argv)
    if os.geteuid() != 0 or not shutil.which("tc"):
        print("bench.multihost: needs root and iproute2 (ip, tc): it makes network namespaces", file=sys.stderr)
        return USAGE
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    topo = Topology(rates)
    work = Path(tempfile.mkdtemp(prefix="ddloco-multihost-"))
    run = _Rehearsal(args, rates, topo, work)
    signal.signal(signal.SIGTERM, lambda *_: run.stop.set())
    try:
        topo.create()
        print(f"network: bridge {BRIDGE} {HOST_IP}/24; " + ", ".join(
            f"learner {i} in {topo.ns(i)} at {topo.ip(i)}, {r} each way" for i, r in enumerate(rates)), flush=True)
        from common.security import create_keys
        create_keys(work / "keys", shards=args.syncers, learners=run.lids)
        password = os.urandom(12).hex()
        with EmbeddedRedis(host=HOST_IP, log_dir=str(work), password=password) as redis_srv:
            run.start(redis_srv)
            run.measure()
    finally:
        run.close()
    _print_result(run.result, rates, args)
    if args.json:
        Path(args.json).write_text(json.dumps(run.result, indent=2))
    return OK if run.result.get("cut", {}).get("rejoin_s") is not None else FAILURE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
