"""A whole run from one Python script: Redis, the broker, two syncer shards and learners as
threads, a 4th learner joining mid-run, then the trained global model.

    python -m examples.python_api            # from the repository root; about a minute on 2 cores

Every ``ddloco`` call here is the code the daemons run; on several machines, run each part as a
process (README, "Running the daemons by hand") with the same run id and task.
"""
from __future__ import annotations

import threading

import ddloco
from ddloco import AlgoConfig, Endpoints, LearnerOptions, RunConfig
from common import control
from common.keys import Keys
from common.redis_server import free_port
from examples.cnn import task
from common.task import evaluate


def main(steps: int = 150) -> dict[str, float]:
    my_task = task()
    stop = threading.Event()
    with ddloco.embedded_redis() as redis:
        ep = Endpoints(run_id="api-demo", redis_url=redis.url, broker_pub=f"tcp://127.0.0.1:{free_port()}",
                       broker_sub=f"tcp://127.0.0.1:{free_port()}")
        run = RunConfig(algo=AlgoConfig())                      # the defaults: P 24, H 12, int4
        daemons = [threading.Thread(target=ddloco.run_broker, kwargs=dict(endpoints=ep, stop=stop))]
        daemons += [threading.Thread(target=ddloco.run_shard, args=(my_task,),
                                     kwargs=dict(endpoints=ep, run=run, stop=stop, shard=k, shards=2,
                                                 options=ddloco.SyncerOptions(checkpoint_dir="")))
                    for k in range(2)]
        for t in daemons:
            t.start()
        try:
            return _train(my_task, ep, run, steps, stop, redis.url)
        finally:
            stop.set()          # the broker and shards end (the shards checkpoint) whatever happened
            for t in daemons:
                t.join()


def _train(my_task: ddloco.Task, ep: Endpoints, run: RunConfig, steps: int, stop: threading.Event,
           redis_url: str) -> dict[str, float]:
    # the shards' initial model (load_global_model waits for the run to appear in Redis)
    initial = evaluate(my_task, ddloco.load_global_model(redis_url=redis_url, run_id=ep.run_id, task=my_task))

    def learner(name: str, stream: int) -> threading.Thread:
        opts = LearnerOptions(learner_id=name, data_shard=stream, max_steps=steps)
        t = threading.Thread(target=ddloco.train, args=(my_task,), kwargs=dict(endpoints=ep, run=run, options=opts))
        t.start()
        return t

    learners = [learner(f"learner-{m}", m) for m in range(3)]
    r = control.connect(redis_url)
    while int(r.hget(Keys(ep.run_id).learner("learner-0"), "steps") or 0) < steps // 3:
        stop.wait(0.2)                                       # the run is under way: a 4th learner joins
    learners.append(learner("learner-late", 3))
    for t in learners:
        t.join()
    model = ddloco.load_global_model(redis_url=redis_url, run_id=ep.run_id, task=my_task)
    final = evaluate(my_task, model)
    print(f"global model held-out loss {initial:.4f} -> {final:.4f} ({final / initial:.2f}x), "
          f"4 learners x {steps} steps, the 4th joined after a third of the run")
    return {"initial": initial, "final": final}


if __name__ == "__main__":
    main()
