//! Where the shared token comes from, and closed-by-default workers.
//!
//! A token can come from a file (`--token-file`), the `LOIP_TOKEN` environment variable or
//! (visible in `ps`, discouraged) the command line. A worker listening on anything but a
//! loopback address refuses to run without one: if none is given it uses `STORE/token`,
//! creating it (32 random bytes, hex, mode 0600) on first start; the token itself is written
//! to that file only (never to a log: the worker prints the file's path). A token file that
//! other users may read or change is refused (`chmod 600 FILE`), as is one that is not a
//! regular file.

use std::io::Write;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::RuntimeError;

/// File name of a worker's own token inside its store.
pub const STORE_TOKEN: &str = "token";
/// Shortest token accepted, characters.
pub const MIN_TOKEN_CHARS: usize = 16;

/// A fresh random token: 32 bytes, hex.
pub fn generate() -> String {
    crate::wire::hex(&rand::random::<[u8; 32]>())
}

fn invalid(m: String) -> RuntimeError {
    RuntimeError::Invalid(m)
}

/// Checks a token's form: printable, at least [`MIN_TOKEN_CHARS`] characters.
pub fn check(token: &str, from: &str) -> Result<(), RuntimeError> {
    if token.chars().count() < MIN_TOKEN_CHARS {
        return Err(invalid(format!(
            "the token from {from} is too short: use at least {MIN_TOKEN_CHARS} characters \
             (a worker makes a strong one in its store when started without a token)"
        )));
    }
    if token.chars().any(|c| c.is_control()) {
        return Err(invalid(format!(
            "the token from {from} contains control characters"
        )));
    }
    Ok(())
}

/// Largest token file read, bytes.
const MAX_TOKEN_FILE: u64 = 4096;

/// Reads a token file: the first line, trimmed. Refused when other users may read or change
/// it, or when it is not a regular file.
pub fn read_file(path: &Path) -> Result<String, RuntimeError> {
    use std::io::Read;
    let io = |e| RuntimeError::Io {
        path: path.to_path_buf(),
        source: e,
    };
    let f = std::fs::File::open(path).map_err(io)?;
    let m = f.metadata().map_err(io)?;
    if !m.is_file() {
        return Err(invalid(format!(
            "token file {} is not a regular file",
            path.display()
        )));
    }
    let mode = m.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(invalid(format!(
            "token file {} can be read or changed by other users (mode {mode:03o}); \
             run `chmod 600 {}` and start again",
            path.display(),
            path.display()
        )));
    }
    let mut text = String::new();
    f.take(MAX_TOKEN_FILE)
        .read_to_string(&mut text)
        .map_err(io)?;
    let token = text.lines().next().unwrap_or("").trim().to_string();
    check(&token, &path.display().to_string())?;
    Ok(token)
}

/// The token named by a `--token-file`, a `--token` or `$LOIP_TOKEN`, in that order.
pub fn from_sources(
    file: Option<&Path>,
    arg: Option<&str>,
) -> Result<Option<String>, RuntimeError> {
    if let Some(f) = file {
        return read_file(f).map(Some);
    }
    if let Some(t) = arg {
        check(t, "--token")?;
        return Ok(Some(t.to_string()));
    }
    match std::env::var("LOIP_TOKEN") {
        Ok(t) if !t.is_empty() => {
            check(&t, "LOIP_TOKEN")?;
            Ok(Some(t))
        }
        _ => Ok(None),
    }
}

/// Whether every address `listen` resolves to is a loopback address.
pub fn is_loopback(listen: &str) -> bool {
    let addrs: Vec<SocketAddr> = match listen.to_socket_addrs() {
        Ok(a) => a.collect(),
        Err(_) => return false,
    };
    !addrs.is_empty() && addrs.iter().all(|a| loopback_ip(a.ip()))
}

fn loopback_ip(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v) => v.is_loopback(),
        IpAddr::V6(v) => v.is_loopback() || v.to_ipv4_mapped().is_some_and(|m| m.is_loopback()),
    }
}

/// What a worker will use: the given token; else, on a loopback address, none; else the
/// store's own token, created if missing. The second value says where a created token was
/// saved (print that path, never the token).
pub fn for_worker(
    given: Option<String>,
    listen: &str,
    store: &Path,
) -> Result<(Option<String>, Option<PathBuf>), RuntimeError> {
    if given.is_some() {
        return Ok((given, None));
    }
    if is_loopback(listen) {
        return Ok((None, None));
    }
    let path = store.join(STORE_TOKEN);
    if path.exists() {
        return Ok((Some(read_file(&path)?), None));
    }
    std::fs::create_dir_all(store).map_err(|e| RuntimeError::Io {
        path: store.to_path_buf(),
        source: e,
    })?;
    let token = generate();
    let io = |e| RuntimeError::Io {
        path: path.clone(),
        source: e,
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(io)?;
    writeln!(f, "{token}").map_err(io)?;
    f.sync_all().map_err(io)?;
    Ok((Some(token), Some(path)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_told_apart() {
        assert!(is_loopback("127.0.0.1:0"));
        assert!(is_loopback("[::1]:7001"));
        assert!(!is_loopback("0.0.0.0:7001"));
        assert!(!is_loopback("10.1.2.3:7001"));
        assert!(!is_loopback("not an address"));
    }

    #[test]
    fn a_worker_off_loopback_makes_and_keeps_its_token() {
        let dir = std::env::temp_dir().join(format!("loip-token-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (t1, made) = for_worker(None, "0.0.0.0:0", &dir).unwrap();
        assert!(made.is_some());
        let path = dir.join(STORE_TOKEN);
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let (t2, made2) = for_worker(None, "0.0.0.0:0", &dir).unwrap();
        assert_eq!((t1.clone(), made2), (t2, None));
        assert_eq!(t1.unwrap().len(), 64);
        assert_eq!(for_worker(None, "127.0.0.1:0", &dir).unwrap(), (None, None));
        assert!(check("short", "x").is_err());
        // a token file others may read is refused, naming the fix
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = read_file(&path).unwrap_err().to_string();
        assert!(e.contains(&format!("chmod 600 {}", path.display())), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
