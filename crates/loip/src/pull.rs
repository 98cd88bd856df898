//! Pulling a model by URL (`loip pull`): a model file (a GGUF) or an HF file set (a directory URL ending in `/`:
//! config.json, tokenizer files and safetensors) downloaded into the model cache, so that
//! `loip list` shows it and `loip generate -m NAME` finds it.
//!
//! Invariants:
//! * a download goes to `FILE.part` beside its place; an interrupted one keeps it and the
//!   next `loip pull` of the same URL resumes it with a `Range` request (a server that
//!   answers the whole file instead restarts it);
//! * a file appears under its own name only by a rename of a complete `.part` whose sha256
//!   matched `--sha256` when given; a mismatch deletes the `.part` and installs nothing;
//! * `pulled.json`, written last, records the URL and every file's size and sha256: a cache
//!   entry without it is not a finished pull and is not resolved as a model.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use loip_plan::units::format_bytes;
use reqwest::StatusCode;
pub use reqwest::Url;

/// The record of a finished pull, `pulled.json`.
const RECORD: &str = "pulled.json";
/// Files of an HF set fetched when the server has them.
const OPTIONAL: [&str; 3] = [
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
];
/// Most bytes of a JSON file of an HF set read (config, index).
const MAX_JSON: u64 = 64 << 20;

/// What to pull.
#[derive(Debug, Clone)]
pub struct Pull<'a> {
    /// http(s) URL of a GGUF file, or of an HF model directory (ending in `/`)
    pub url: &'a str,
    /// expected sha256 of the file (hex); a mismatch installs nothing
    pub sha256: Option<&'a str>,
    /// name in the cache (default: from the URL)
    pub name: Option<&'a str>,
    /// longest wait for a byte from the server
    pub read_timeout: Duration,
}

/// What a pull says while it runs.
pub enum Event<'a> {
    /// a file's download starts at byte `start` of `total` (when the server says)
    Begin {
        /// the file's URL
        url: &'a Url,
        /// bytes already kept from an earlier try
        start: u64,
        /// the file's size, when known
        total: Option<u64>,
    },
    /// bytes of the current file so far
    Bytes(u64),
    /// the current file's download ended
    End {
        /// every byte came
        complete: bool,
    },
    /// something worth telling (a resumed or restarted download)
    Note(String),
}

/// What a finished pull installed.
pub struct Outcome {
    /// the cache name
    pub name: String,
    /// the cache entry's directory
    pub dir: std::path::PathBuf,
    /// the files installed
    pub files: Vec<Pulled>,
}

/// Downloads, verifies, installs and records `p` into the model cache, telling `on` how
/// it goes.
pub fn pull(p: &Pull<'_>, on: &mut dyn FnMut(Event<'_>)) -> Result<Outcome> {
    let url = Url::parse(p.url).with_context(|| format!("{} is not a URL", p.url))?;
    if !matches!(url.scheme(), "http" | "https") {
        bail!(
            "loip pull takes an http or https URL, not {}:",
            url.scheme()
        );
    }
    let want = p
        .sha256
        .map(|h| {
            let h = h.trim().to_ascii_lowercase();
            if h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()) {
                Ok(h)
            } else {
                Err(anyhow::anyhow!("--sha256 takes 64 hex digits, not {h:?}"))
            }
        })
        .transpose()?;
    let set = url.path().ends_with('/');
    if set && want.is_some() {
        bail!("--sha256 checks one file; an HF file set (a URL ending in /) takes none");
    }
    let name = match p.name {
        Some(n) => n.to_string(),
        None => default_name(&url)?,
    };
    check_name(&name)?;
    let dir = loip_model::fetch::cache_dir().join(&name);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the download runtime")?;
    let client = client(p.read_timeout.max(Duration::from_secs(1)))?;
    let files = rt.block_on(async {
        if set {
            pull_set(&client, &url, &dir, on).await
        } else {
            let file = file_name(&url)?;
            let got = pull_file(&client, &url, &dir, &file, want.as_deref(), on).await?;
            Ok(vec![got])
        }
    });
    let files = files.inspect_err(|_| {
        // nothing came (no `.part` kept): no empty entry is left in the cache
        let _ = std::fs::remove_dir(&dir);
    })?;
    let record = serde_json::json!({
        "url": url.as_str(),
        "files": files.iter().map(|f| serde_json::json!({
            "name": f.name, "bytes": f.bytes, "sha256": f.sha256,
        })).collect::<Vec<_>>(),
    });
    let text = serde_json::to_string_pretty(&record)?;
    std::fs::write(dir.join(RECORD), text + "\n")
        .with_context(|| format!("writing {}", dir.join(RECORD).display()))?;
    Ok(Outcome { name, dir, files })
}

/// The HTTP client: https through rustls with the web's root certificates and the crypto
/// provider `main` installs, bounded waits.
fn client(read_timeout: Duration) -> Result<reqwest::Client> {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(30))
        .read_timeout(read_timeout)
        .user_agent(concat!("loip/", env!("CARGO_PKG_VERSION")))
        .build()
        .context("building the HTTP client")
}

/// A file installed by a pull.
pub struct Pulled {
    /// its file name in the entry
    pub name: String,
    /// its size, bytes
    pub bytes: u64,
    /// its sha256, hex
    pub sha256: String,
}

/// The cache name for `url`: its last path segment without the extension (a file), or the
/// directory's name (a URL ending in `/`).
fn default_name(url: &Url) -> Result<String> {
    let segs: Vec<&str> = url
        .path_segments()
        .map(|s| s.filter(|p| !p.is_empty()).collect())
        .unwrap_or_default();
    let last = segs
        .last()
        .ok_or_else(|| anyhow::anyhow!("{url} names no file; give --name"))?;
    let stem = if url.path().ends_with('/') {
        last
    } else {
        Path::new(last)
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or(last)
    };
    Ok(stem.to_string())
}

/// The last path segment of a file URL.
fn file_name(url: &Url) -> Result<String> {
    let name = url
        .path_segments()
        .and_then(|mut s| s.next_back())
        .filter(|s| !s.is_empty())
        .ok_or_else(|| anyhow::anyhow!("{url} names no file"))?;
    check_name(name)?;
    Ok(name.to_string())
}

/// A name that stays one plain entry of the cache (no path, no dot file, not a known
/// model's name, which `loip fetch` owns).
fn check_name(name: &str) -> Result<()> {
    let plain = !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | '+'));
    if !plain {
        bail!("{name:?} is not a plain name (letters, digits, . - _ +); give --name");
    }
    if loip_model::fetch::KNOWN_MODELS.contains(&name) || name == "slices" || name == "bench-stores"
    {
        bail!("{name} is a name the cache keeps for itself; give another --name");
    }
    Ok(())
}

/// Downloads `url` to `dir/file` (through `dir/file.part`, resumed when there), checks
/// `want`, and installs it.
async fn pull_file(
    client: &reqwest::Client,
    url: &Url,
    dir: &Path,
    file: &str,
    want: Option<&str>,
    on: &mut dyn FnMut(Event<'_>),
) -> Result<Pulled> {
    let dest = dir.join(file);
    let part = dir.join(format!("{file}.part"));
    download(client, url, &part, on).await?;
    let sha256 = loip_model::fetch::sha256_file(&part)?;
    if let Some(want) = want {
        if sha256 != want {
            let _ = std::fs::remove_file(&part);
            let _ = std::fs::remove_dir(dir); // only when empty
            bail!(
                "{url}: sha256 {sha256} is not the expected {want}; the download was deleted \
                 and nothing was installed"
            );
        }
    }
    let bytes = std::fs::metadata(&part)
        .with_context(|| format!("reading {}", part.display()))?
        .len();
    std::fs::rename(&part, &dest)
        .with_context(|| format!("renaming {} to {}", part.display(), dest.display()))?;
    Ok(Pulled {
        name: file.to_string(),
        bytes,
        sha256,
    })
}

/// Streams `url` into `part`, from its current length when the server honours a `Range`.
async fn download(
    client: &reqwest::Client,
    url: &Url,
    part: &Path,
    on: &mut dyn FnMut(Event<'_>),
) -> Result<()> {
    let have = std::fs::metadata(part).map(|m| m.len()).unwrap_or(0);
    let mut req = client.get(url.clone());
    if have > 0 {
        req = req.header(reqwest::header::RANGE, format!("bytes={have}-"));
    }
    let mut resp = req.send().await.map_err(|e| net_error(url, e))?;
    let status = resp.status();
    let (mut file, start) = match status {
        StatusCode::PARTIAL_CONTENT if have > 0 => {
            let from = resp
                .headers()
                .get(reqwest::header::CONTENT_RANGE)
                .and_then(|v| v.to_str().ok())
                .and_then(range_start);
            if from != Some(have) {
                bail!("{url}: the server resumed at {from:?}, not at byte {have}; delete {} to start over", part.display());
            }
            on(Event::Note(format!(
                "resuming {} at {}",
                url,
                format_bytes(have)
            )));
            let f = std::fs::OpenOptions::new()
                .append(true)
                .open(part)
                .with_context(|| format!("opening {}", part.display()))?;
            (f, have)
        }
        StatusCode::RANGE_NOT_SATISFIABLE if have > 0 => {
            // what is kept is not a prefix of what the server has now: start over
            std::fs::remove_file(part).with_context(|| format!("removing {}", part.display()))?;
            return Box::pin(download(client, url, part, on)).await;
        }
        s if s.is_success() => {
            if have > 0 {
                on(Event::Note(format!(
                    "the server sends {url} whole; starting over"
                )));
            }
            let f = std::fs::File::create(part)
                .with_context(|| format!("creating {}", part.display()))?;
            (f, 0)
        }
        StatusCode::NOT_FOUND => bail!("{url}: 404 Not Found (nothing to pull there)"),
        s => bail!("{url}: the server answered {s}"),
    };
    let total = resp.content_length().map(|n| n + start);
    on(Event::Begin { url, start, total });
    let mut got = start;
    loop {
        let chunk = match resp.chunk().await {
            Ok(Some(c)) => c,
            Ok(None) => break,
            Err(e) => {
                on(Event::End { complete: false });
                let _ = file.flush();
                bail!(
                    "{url}: the download stopped after {} of {} ({e}); {} is kept: run the same \
                     loip pull again to resume",
                    format_bytes(got),
                    total.map_or("?".into(), format_bytes),
                    part.display()
                );
            }
        };
        file.write_all(&chunk)
            .with_context(|| format!("writing {}", part.display()))?;
        got += chunk.len() as u64;
        on(Event::Bytes(got));
    }
    file.flush()
        .with_context(|| format!("writing {}", part.display()))?;
    on(Event::End { complete: true });
    if let Some(t) = total {
        if got != t {
            bail!(
                "{url}: the server closed after {} of {}; {} is kept: run the same loip pull \
                 again to resume",
                format_bytes(got),
                format_bytes(t),
                part.display()
            );
        }
    }
    Ok(())
}

/// The first byte of a `Content-Range: bytes FIRST-LAST/TOTAL` header.
fn range_start(v: &str) -> Option<u64> {
    let r = v.trim().strip_prefix("bytes ")?;
    r.split('-').next()?.trim().parse().ok()
}

/// A request that failed before an answer, said plainly.
fn net_error(url: &Url, e: reqwest::Error) -> anyhow::Error {
    if e.is_connect() {
        return anyhow::anyhow!("{url}: could not connect ({e})");
    }
    if e.is_timeout() {
        return anyhow::anyhow!("{url}: no answer in time ({e})");
    }
    anyhow::anyhow!("{url}: {e}")
}

/// An HF file set under the directory URL `base`: config.json, tokenizer.json, the optional
/// tokenizer and generation configs, and the safetensors (one file, or the shards of the
/// index).
async fn pull_set(
    client: &reqwest::Client,
    base: &Url,
    dir: &Path,
    on: &mut dyn FnMut(Event<'_>),
) -> Result<Vec<Pulled>> {
    let mut out = Vec::new();
    let join = |f: &str| {
        base.join(f)
            .with_context(|| format!("{base}{f} is not a URL"))
    };
    for f in ["config.json", "tokenizer.json"] {
        out.push(pull_file(client, &join(f)?, dir, f, None, on).await?);
    }
    for f in OPTIONAL {
        match pull_file(client, &join(f)?, dir, f, None, on).await {
            Ok(p) => out.push(p),
            Err(e) if e.to_string().contains("404") => {}
            Err(e) => return Err(e),
        }
    }
    let index = "model.safetensors.index.json";
    match pull_file(client, &join(index)?, dir, index, None, on).await {
        Ok(p) => {
            let shards = shards(&dir.join(index))?;
            out.push(p);
            for s in shards {
                out.push(pull_file(client, &join(&s)?, dir, &s, None, on).await?);
            }
        }
        Err(e) if e.to_string().contains("404") => {
            let f = "model.safetensors";
            out.push(pull_file(client, &join(f)?, dir, f, None, on).await?);
        }
        Err(e) => return Err(e),
    }
    Ok(out)
}

/// The shard files an HF index names (`weight_map` values), each a plain file name.
fn shards(index: &Path) -> Result<Vec<String>> {
    let len = std::fs::metadata(index)
        .with_context(|| format!("reading {}", index.display()))?
        .len();
    if len > MAX_JSON {
        bail!(
            "{}: {} is too large for an index",
            index.display(),
            format_bytes(len)
        );
    }
    let text =
        std::fs::read_to_string(index).with_context(|| format!("reading {}", index.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", index.display()))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| anyhow::anyhow!("{}: no weight_map", index.display()))?;
    let mut names: Vec<String> = map
        .values()
        .filter_map(|s| s.as_str().map(str::to_string))
        .collect();
    names.sort();
    names.dedup();
    for n in &names {
        check_name(n).with_context(|| format!("{}: shard {n:?}", index.display()))?;
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_come_from_the_url_and_stay_plain() {
        let u = Url::parse("http://h/a/SmolLM2.Q4_1.gguf").unwrap();
        assert_eq!(default_name(&u).unwrap(), "SmolLM2.Q4_1");
        let d = Url::parse("http://h/models/my-model/").unwrap();
        assert_eq!(default_name(&d).unwrap(), "my-model");
        assert!(check_name("../x").is_err());
        assert!(check_name(".hidden").is_err());
        assert!(check_name("smollm2").is_err());
        assert!(check_name("ok-name_1.2").is_ok());
        assert_eq!(range_start("bytes 100-199/200"), Some(100));
        assert_eq!(range_start("bytes */200"), None);
    }

    #[test]
    fn the_client_speaks_https_without_a_c_crypto_library() {
        let _ = rustls_rustcrypto::provider().install_default();
        let c = client(Duration::from_secs(5)).unwrap();
        // building a request for https needs the TLS stack compiled in
        assert!(c.get("https://127.0.0.1:9/").build().is_ok());
    }
}
