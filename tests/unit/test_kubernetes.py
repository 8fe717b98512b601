"""kubernetes/: the manifests validate offline against the Kubernetes API schemas
(kubernetes-validate, strict), render (as `kubectl apply -k` would: the kustomization's resources,
labels and image) into the objects docs/deploy.md names, agree with each other, and the Secrets
`python -m ddloco.k8s secrets` prints hold keys a pod unpacks alone and an ACL file a real Redis
accepts. No cluster runs here."""
from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import wait_until

yaml = pytest.importorskip("yaml")
kv = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "kubernetes"
VERSION = "1.30.0"


def render() -> list[dict]:
    """The objects `kubectl apply -k kubernetes/` creates: each resource file's documents with the
    kustomization's labels (metadata only, as `labels:` without includeSelectors) and image tag."""
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    labels = {k: v for entry in kust.get("labels", []) for k, v in entry["pairs"].items()}
    images = {i["name"]: f"{i.get('newName', i['name'])}:{i['newTag']}" for i in kust.get("images", [])}
    out = []
    for name in kust["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            doc["metadata"].setdefault("labels", {}).update(labels)
            spec = doc.get("spec", {}).get("template", {}).get("spec", {})
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                c["image"] = images.get(c["image"], c["image"])
            out.append(doc)
    return out


def by(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def secrets(tmp_path: Path, learners: int = 3) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "ddloco.k8s", "secrets", "--keys", str(tmp_path / "keys"),
                          "--learners", str(learners), "--shards", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return list(yaml.safe_load_all(out.stdout))


def test_every_manifest_and_secret_validates_against_the_kubernetes_api_schemas(tmp_path):
    objs = render() + secrets(tmp_path)
    for obj in objs:
        kv.validate(obj, VERSION, strict=True)   # raises ValidationError naming the field
    bad = dict(by(objs, "Service", "ddloco-broker"))
    bad["spec"] = {**bad["spec"], "ports": [{"name": "xsub", "port": "not a port"}]}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, VERSION, strict=True)


def test_the_rendered_objects_are_the_ones_the_docs_name(tmp_path):
    objs = render()
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objs) == [
        ("Deployment", "ddloco-broker"), ("Service", "ddloco-broker"), ("Service", "ddloco-learner"),
        ("Service", "ddloco-redis"), ("Service", "ddloco-syncer"), ("StatefulSet", "ddloco-learner"),
        ("StatefulSet", "ddloco-redis"), ("StatefulSet", "ddloco-syncer")]
    assert all(o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "ddloco" for o in objs)
    syncer, learner = by(objs, "StatefulSet", "ddloco-syncer"), by(objs, "StatefulSet", "ddloco-learner")
    redis = by(objs, "StatefulSet", "ddloco-redis")
    assert [t["metadata"]["name"] for t in syncer["spec"]["volumeClaimTemplates"]] == ["checkpoints"]
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert '--shard "${POD_NAME##*-}"' in syncer["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert by(objs, "Service", "ddloco-syncer")["spec"]["clusterIP"] == "None"
    lc = learner["spec"]["template"]["spec"]["containers"][0]
    assert lc["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert '--learner-id "learner-$i"' in lc["args"][0]
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            pod = o["spec"]["template"]
            for c in pod["spec"]["containers"]:
                assert "readinessProbe" in c and "livenessProbe" in c, o["metadata"]["name"]
            assert pod["spec"]["automountServiceAccountToken"] is False
            if o["metadata"]["name"] != "ddloco-redis":
                assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
                # the daemon's container never mounts the Secret of every key, only its own unpacked
                mounts = {m["name"] for c in pod["spec"]["containers"] for m in c["volumeMounts"]}
                assert "all-keys" not in mounts and "keys" in mounts


def test_shard_count_and_run_id_agree_across_the_manifests():
    objs = render()
    broker = by(objs, "Deployment", "ddloco-broker")["spec"]["template"]["spec"]["containers"][0]["args"]
    syncer = by(objs, "StatefulSet", "ddloco-syncer")
    shards = broker[broker.index("--shards") + 1]
    assert int(shards) == syncer["spec"]["replicas"]
    assert f"--shards {shards}" in syncer["spec"]["template"]["spec"]["containers"][0]["args"][0]
    learner_args = by(objs, "StatefulSet", "ddloco-learner")["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert "--run-id k8s" in learner_args and broker[broker.index("--run-id") + 1] == "k8s"
    for o in objs:   # a daemon given a run id checks the run's Redis at start: it needs a URL
        for c in o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            if "--run-id" in " ".join(c.get("args", [])) and "learner" not in c["name"]:
                assert "DDLOCO_REDIS_URL" in {e["name"] for e in c.get("env", [])}, o["metadata"]["name"]


def test_a_pod_unpacks_its_own_secret_key_and_no_other(tmp_path):
    from ddloco import k8s
    docs = secrets(tmp_path)
    flat = tmp_path / "all"
    flat.mkdir()
    for key, value in by(docs, "Secret", "ddloco-keys")["data"].items():
        (flat / key).write_bytes(base64.b64decode(value))
    k8s.unpack(flat, tmp_path / "pod", "learner-1")
    secret = sorted(p.name for p in (tmp_path / "pod" / "secret").iterdir())
    assert secret == ["learner-1.key_secret", "learner-1.redis.env"]
    assert (tmp_path / "pod" / "public" / "learner" / "learner-2.key").exists()
    assert (tmp_path / "pod" / "public" / "broker" / "broker.key").exists()
    with pytest.raises(SystemExit, match="no secret key for 'learner-9'"):
        k8s.unpack(flat, tmp_path / "pod9", "learner-9")
    again = secrets(tmp_path)   # kept: running it again changes no key or password
    assert by(again, "Secret", "ddloco-keys")["data"] == by(docs, "Secret", "ddloco-keys")["data"]


def test_the_acl_file_confines_each_learner_in_a_real_redis(tmp_path):
    import redis as redis_py
    from common.keys import Keys
    from common.redis_server import binary_has_selectors, find_redis_server, free_port
    binary = find_redis_server()
    if not binary_has_selectors(binary):
        pytest.skip("needs redis-server >= 7.0")
    docs = secrets(tmp_path)
    red = {k: base64.b64decode(v).decode() for k, v in by(docs, "Secret", "ddloco-redis")["data"].items()}
    keys = {k: base64.b64decode(v).decode() for k, v in by(docs, "Secret", "ddloco-keys")["data"].items()}
    (tmp_path / "users.acl").write_text(red["users.acl"])
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--aclfile", str(tmp_path / "users.acl"), "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        def url(u: str) -> str:
            return u.strip().split("=", 1)[-1].replace("ddloco-redis:6379", f"127.0.0.1:{port}")
        admin = redis_py.Redis.from_url(url(red["admin-url"]))

        def answers() -> bool:
            try:
                return bool(admin.ping())
            except redis_py.ConnectionError:
                return False
        wait_until(answers, 10, what="redis-server with the generated ACL file")
        l1 = redis_py.Redis.from_url(url(keys["secret--learner-1.redis.env"]))
        keys_of = Keys("k8s")
        l1.hset(keys_of.learner("learner-1"), "steps", 1)          # its own key
        with pytest.raises(redis_py.exceptions.NoPermissionError):
            l1.hset(keys_of.learner("learner-2"), "steps", 1)      # another learner's
    finally:
        proc.terminate()
        proc.wait()
