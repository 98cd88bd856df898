# Sourced by the llama.cpp comparison scripts (from the repository root): builds llama.cpp once
# per instruction set from llama-cpp-python's source release (its vendored llama.cpp), with
# CMake, into target/llama-BUILD-build (shared libraries, and `llama-server` when asked), and
# installs the Python bindings without a second build into that build's venv, their library
# directory a link to the CMake build's. One compile gives both the bindings and the server.
#
# BUILD is "native" (this CPU; made without AMX where the CPU lists it, as some VMs list AMX but
# fault on it: -mno-amx-tile -mno-amx-int8 -mno-amx-bf16, keeping llama.cpp's weight
# repacking) or "avx2" (AVX2 + FMA + F16C without AVX-512). LLAMA_NICE (default 19) is the
# niceness of the compile on a shared machine; LLAMA_CPP_PYTHON (default 0.3.36) the release.
# CMake and Ninja come from the PATH or, where absent, a venv of their own (target/llama-tools).

llama_version=${LLAMA_CPP_PYTHON:-0.3.36}
llama_amx=0
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then llama_amx=1; fi

llama_build_dir() { # BUILD
    echo "target/llama-$1-build"
}

llama_venv() { # BUILD
    if [ "$1" = avx2 ]; then
        echo target/llama-venv-avx2
    elif [ "$llama_amx" = 1 ]; then
        echo target/llama-venv-noamx
    else
        echo target/llama-venv
    fi
}

llama_tools() { # puts cmake and ninja on the PATH
    if command -v cmake >/dev/null && command -v ninja >/dev/null; then
        return
    fi
    if [ ! -x target/llama-tools/bin/cmake ] || [ ! -x target/llama-tools/bin/ninja ]; then
        python3 -m venv target/llama-tools
        target/llama-tools/bin/pip install --quiet cmake ninja
    fi
    PATH=$PWD/target/llama-tools/bin:$PATH
}

llama_source() { # prints the directory of the unpacked source release, fetching it once
    local dir=target/llama-src
    local src=$dir/llama_cpp_python-$llama_version
    if [ ! -f "$src/vendor/llama.cpp/CMakeLists.txt" ]; then
        mkdir -p "$dir"
        # the source release only (its build backend's CMake comes as a binary wheel)
        python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python \
            -d "$dir" "llama-cpp-python==$llama_version" >&2
        tar xzf "$dir/llama_cpp_python-$llama_version.tar.gz" -C "$dir"
    fi
    echo "$src"
}

llama_configure() { # BUILD: the CMake configuration of that build (once)
    local out src
    out=$(llama_build_dir "$1")
    [ -f "$out/build.ninja" ] && return
    src=$(llama_source)
    local args=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF)
    if [ "$1" = avx2 ]; then
        args+=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
            -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
            -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF)
    elif [ "$llama_amx" = 1 ]; then
        local no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        args+=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
            "-DCMAKE_C_FLAGS=$no_amx" "-DCMAKE_CXX_FLAGS=$no_amx")
    fi
    cmake -S "$src/vendor/llama.cpp" -B "$out" -G Ninja "${args[@]}" >&2
}

llama_compile() { # BUILD TARGET...: compiles those targets of that build, nice'd
    local b=$1
    shift
    llama_tools
    llama_configure "$b"
    nice -n "${LLAMA_NICE:-19}" cmake --build "$(llama_build_dir "$b")" -j "$(nproc)" \
        --target "$@" >&2
}

install_llama() { # BUILD: the bindings in that build's venv unless present
    local venv
    venv=$(llama_venv "$1")
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
        return
    fi
    llama_compile "$1" llama
    if ! compgen -G "$venv/lib/python3*/site-packages/llama_cpp/llama.py" >/dev/null; then
        python3 -m venv "$venv"
        # the bindings alone: their CMake project without building llama.cpp again
        CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$venv/bin/pip" install --quiet \
            --no-cache-dir "target/llama-src/llama_cpp_python-$llama_version.tar.gz"
    fi
    local pkg
    pkg=$("$venv/bin/python" -c "import importlib.util as u; print(u.find_spec('llama_cpp').submodule_search_locations[0])")
    rm -rf "$pkg/lib"
    ln -s "$PWD/$(llama_build_dir "$1")/bin" "$pkg/lib"
}

llama_server_bin() { # BUILD: the path of that build's llama-server, compiling it once
    local bin
    bin=$(llama_build_dir "$1")/bin/llama-server
    if [ ! -x "$bin" ]; then
        llama_compile "$1" llama-server
    fi
    echo "$bin"
}
