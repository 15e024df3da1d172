#!/usr/bin/env bash
# Validates the Kubernetes manifests under deploy/ offline, against the schemas shipped in the
# PyPI package kubernetes-validate (strict: unknown fields fail), for the oldest and newest
# Kubernetes versions it ships schemas for. Also checks that every kustomization lists files
# that exist, that every manifest belongs to a kustomization or to examples/, and that the
# Dockerfile's Rust image is the toolchain rust-toolchain.toml pins (the image build does not
# read rust-toolchain.toml).
#
# Installs the validator once into a cached venv (PDGATE_VALIDATE_VENV, default
# ~/.cache/pdgate/validate-venv); needs python3 and, the first time, PyPI.
# Usage: deploy/validate.sh            exit 0 when everything is valid
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
validator_version="1.37.0"
kube_versions=(1.33.0 1.37.0)
venv="${PDGATE_VALIDATE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/pdgate/validate-venv}"

if ! "$venv/bin/kubernetes-validate" --version 2>/dev/null | grep -qx "$validator_version"; then
  echo "validate.sh: installing kubernetes-validate==$validator_version into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "kubernetes-validate==$validator_version"
fi
kv="$venv/bin/kubernetes-validate"
py="$venv/bin/python"

# Custom resources (InferencePool, Envoy Gateway's policies) are checked below against their
# CRDs, not here.
custom_api='^apiVersion: (inference\.networking\.k8s\.io|gateway\.envoyproxy\.io)/'
mapfile -t manifests < <(cd "$here" && grep -LE "$custom_api" \
  $(find kubernetes -name '*.yaml' ! -name kustomization.yaml) | sort)
mapfile -t custom < <(cd "$here" && grep -lE "$custom_api" \
  $(find kubernetes -name '*.yaml' ! -name kustomization.yaml) | sort)
if [ "${#manifests[@]}" -eq 0 ]; then
  echo "validate.sh: no manifests found under $here/kubernetes" >&2
  exit 1
fi

# The validator must reject a broken manifest, or a pass below means nothing.
bad="$(mktemp --suffix=.yaml)"
trap 'rm -f "$bad"' EXIT
cat >"$bad" <<'YAML'
apiVersion: apps/v1
kind: Deployment
metadata: {name: broken}
spec:
  replica: 3
  selector: {matchLabels: {a: b}}
  template:
    metadata: {labels: {a: b}}
    spec: {containers: [{name: c, image: x, ports: [{containerPort: "http"}]}]}
YAML
if "$kv" --strict --quiet "$bad" >/dev/null 2>&1; then
  echo "validate.sh: self-test failed: the validator accepted a broken Deployment" >&2
  exit 1
fi

failed=0
for version in "${kube_versions[@]}"; do
  if (cd "$here" && "$kv" --strict --quiet -k "$version" "${manifests[@]}"); then
    echo "validate.sh: ${#manifests[@]} files valid against Kubernetes $version (strict)"
  else
    echo "validate.sh: manifests invalid against Kubernetes $version" >&2
    failed=1
  fi
done

# Custom resources against the CRDs kept in deploy/crds (strict: unknown fields fail, like the
# API server's structural-schema pruning would drop them), with a self-test first.
if ! (cd "$here" && "$py" - "${custom[@]}" <<'PY'
import glob, sys, yaml, jsonschema

def strict(schema):
    # An object schema without additionalProperties/x-kubernetes-preserve-unknown-fields
    # prunes unknown fields in the API server: refuse them here.
    if isinstance(schema, dict):
        if schema.get("type") == "object" and "properties" in schema \
                and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema = dict(schema, additionalProperties=False)
        return {k: strict(v) for k, v in schema.items()}
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema

schemas = {}
for path in glob.glob("crds/*.yaml"):
    with open(path) as f:
        crd = next(d for d in yaml.safe_load_all(f) if d)
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    for v in crd["spec"]["versions"]:
        root = strict(v["schema"]["openAPIV3Schema"])
        # metadata is the API server's (ObjectMeta), not the CRD's to describe.
        root.setdefault("properties", {})["metadata"] = {"type": "object"}
        schemas[(f"{group}/{v['name']}", kind)] = root

def check(doc):
    schema = schemas.get((doc.get("apiVersion"), doc.get("kind")))
    if schema is None:
        return [f"no CRD in deploy/crds for {doc.get('apiVersion')} {doc.get('kind')}"]
    return [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]

broken = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
          "metadata": {"name": "x"}, "spec": {"selector": {"matchLabels": {"a": "b"}},
          "targetPort": [{"number": 8000}]}}
if not check(broken):
    sys.exit("validate.sh: self-test failed: the CRD schema accepted a broken InferencePool")
broken = {"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "EnvoyExtensionPolicy",
          "metadata": {"name": "x"}, "spec": {"extProc": [{"backendRefs": [{"name": "p"}],
          "processingMode": {"request": {"body": "Whole"}}}]}}
if not check(broken):
    sys.exit("validate.sh: self-test failed: the CRD schema accepted a broken EnvoyExtensionPolicy")
errors = []
for path in sys.argv[1:]:
    with open(path) as f:
        for doc in yaml.safe_load_all(f):
            if doc:
                errors += [f"{path}: {e}" for e in check(doc)]
for e in errors:
    print(f"validate.sh: {e}", file=sys.stderr)
print(f"validate.sh: {len(sys.argv) - 1} custom-resource files valid against deploy/crds")
sys.exit(1 if errors else 0)
PY
); then
  failed=1
fi

# Kustomizations: listed resources exist; every manifest outside examples/ is listed somewhere.
if ! (cd "$here" && "$py" - "${manifests[@]}" <<'PY'
import os, sys, yaml
manifests = set(sys.argv[1:])
listed, errors = set(), []
for root, _, files in os.walk("kubernetes"):
    if "kustomization.yaml" not in files:
        continue
    path = os.path.join(root, "kustomization.yaml")
    with open(path) as f:
        k = yaml.safe_load(f)
    if k.get("kind") != "Kustomization":
        errors.append(f"{path}: kind is not Kustomization")
    for r in k.get("resources", []):
        target = os.path.normpath(os.path.join(root, r))
        if not os.path.exists(target):
            errors.append(f"{path}: resource {r} does not exist")
        listed.add(target)
for m in sorted(manifests):
    if "/examples/" not in m and os.path.normpath(m) not in listed:
        errors.append(f"{m}: not listed in any kustomization.yaml")
for e in errors:
    print(f"validate.sh: {e}", file=sys.stderr)
sys.exit(1 if errors else 0)
PY
); then
  failed=1
else
  echo "validate.sh: kustomizations consistent"
fi

# The build stage's rust image tag must be the pinned toolchain.
channel="$(sed -n 's/^channel *= *"\(.*\)"$/\1/p' "$here/../rust-toolchain.toml")"
from_tag="$(sed -n 's/^FROM rust:\([^ -]*\)-.* AS build$/\1/p' "$here/docker/Dockerfile")"
if [ -n "$channel" ] && [ "$channel" = "$from_tag" ]; then
  echo "validate.sh: Dockerfile builds with rust $from_tag, as rust-toolchain.toml pins"
else
  echo "validate.sh: Dockerfile rust image '${from_tag}' is not rust-toolchain.toml's '${channel}'" >&2
  failed=1
fi

if [ "$failed" -ne 0 ]; then
  echo "validate.sh: FAILED" >&2
  exit 1
fi
echo "validate.sh: OK"
