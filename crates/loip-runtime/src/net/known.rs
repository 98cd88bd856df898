//! The coordinator's pins of its devices' static keys (trust on first use), like ssh's
//! `known_hosts`: one line per device, `NAME HEXKEY`, in a known-devices file (`loip` keeps it
//! beside the cluster file; `--known-devices FILE` or `$LOIP_KNOWN_DEVICES` names another).
//!
//! The first session with a device records its key; a later session whose device proves
//! another key is refused with an error naming the device, both fingerprints and how to
//! accept the new key (`--accept-new-key NAME`, or deleting its line). Lines that are not
//! `NAME HEXKEY` (comments, blanks) are kept as they are. The file is rewritten whole through
//! a temporary file and a rename, so a reader never sees half of it.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::net::identity::KEY_BYTES;

/// The known-devices file of a coordinator: `flag` (`--known-devices`), else
/// `$LOIP_KNOWN_DEVICES`, else `known_devices` beside the cluster file.
pub fn resolve_path(flag: Option<&Path>, cluster_file: &Path) -> PathBuf {
    if let Some(f) = flag {
        return f.to_path_buf();
    }
    match std::env::var_os("LOIP_KNOWN_DEVICES") {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => cluster_file.with_file_name("known_devices"),
    }
}

/// Largest known-devices file read, bytes.
const MAX_FILE: u64 = 1 << 20;

/// A known-devices file and the devices whose new key this run accepts.
#[derive(Debug)]
pub struct KnownDevices {
    path: PathBuf,
    accept_new: HashSet<String>,
    lock: Mutex<()>, // one check-and-record at a time within this process
}

/// What [`KnownDevices::check`] did with a device's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pin {
    /// the key is the one pinned
    Known,
    /// no key was pinned for the device: this one is now
    New,
    /// another key was pinned and this run accepts the new one: replaced
    Replaced,
}

fn short(key: &[u8; KEY_BYTES]) -> String {
    crate::wire::hex(&key[..8])
}

impl KnownDevices {
    /// The pins in `path` (created on first use); `accept_new`: devices whose changed key is
    /// accepted (and recorded) this time.
    pub fn new(path: impl Into<PathBuf>, accept_new: impl IntoIterator<Item = String>) -> Self {
        KnownDevices {
            path: path.into(),
            accept_new: accept_new.into_iter().collect(),
            lock: Mutex::new(()),
        }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Checks `device`'s proved static key against its pin, recording it on first contact.
    /// Err: a message for the user (the key changed and is not accepted, or the file cannot
    /// be read or written).
    pub fn check(&self, device: &str, key: &[u8; KEY_BYTES]) -> Result<Pin, String> {
        if device.is_empty() || device.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(format!(
                "device name {device:?} cannot be pinned (no spaces or control characters)"
            ));
        }
        let _g = match self.lock.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let text = self.read()?;
        let hex = crate::wire::hex(key);
        let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
        let at = lines.iter().position(|l| {
            let mut w = l.split_whitespace();
            w.next() == Some(device) && w.next().is_some()
        });
        let pin = match at {
            None => {
                lines.push(format!("{device} {hex}"));
                Pin::New
            }
            Some(i) => {
                let pinned = lines[i].split_whitespace().nth(1).unwrap_or("");
                if crate::net::direct::same_secret(pinned, &hex) {
                    return Ok(Pin::Known);
                }
                if !self.accept_new.contains(device) {
                    let was = crate::net::session::unhex::<KEY_BYTES>(pinned)
                        .map_or_else(|| pinned.chars().take(16).collect(), |k| short(&k));
                    return Err(format!(
                        "device {device} proved a key that is not the one pinned for it \
                         (now {}…, pinned {was}… in {}): the device's store was replaced, or \
                         another machine answers at its address. If the change is expected, \
                         run again with --accept-new-key {device}, or delete the line of \
                         {device} from {}",
                        short(key),
                        self.path.display(),
                        self.path.display()
                    ));
                }
                lines[i] = format!("{device} {hex}");
                Pin::Replaced
            }
        };
        self.write(&lines)?;
        Ok(pin)
    }

    fn read(&self) -> Result<String, String> {
        use std::io::Read;
        let f = match std::fs::File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(String::new()),
            Err(e) => return Err(format!("reading {}: {e}", self.path.display())),
        };
        let mut text = String::new();
        f.take(MAX_FILE + 1)
            .read_to_string(&mut text)
            .map_err(|e| format!("reading {}: {e}", self.path.display()))?;
        if text.len() as u64 > MAX_FILE {
            return Err(format!(
                "{} is over {MAX_FILE} bytes: not a known-devices file",
                self.path.display()
            ));
        }
        Ok(text)
    }

    fn write(&self, lines: &[String]) -> Result<(), String> {
        let err = |e: std::io::Error| format!("writing {}: {e}", self.path.display());
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        let mut tmp = self.path.clone().into_os_string();
        tmp.push(format!(".tmp{}", std::process::id()));
        let mut text = lines.join("\n");
        text.push('\n');
        std::fs::write(&tmp, text).map_err(err)?;
        std::fs::rename(&tmp, &self.path).map_err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_use_pins_a_change_is_refused_unless_accepted() {
        let dir = std::env::temp_dir().join(format!("loip-known-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("known_devices");
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let k = KnownDevices::new(&path, []);
        assert_eq!(k.check("dev-a", &a), Ok(Pin::New));
        assert_eq!(k.check("dev-a", &a), Ok(Pin::Known));
        assert_eq!(k.check("dev-b", &b), Ok(Pin::New));
        let e = k.check("dev-a", &b).unwrap_err();
        assert!(
            e.contains("dev-a") && e.contains("--accept-new-key dev-a"),
            "{e}"
        );
        assert!(e.contains(&path.display().to_string()), "{e}");
        let k = KnownDevices::new(&path, ["dev-a".to_string()]);
        assert_eq!(k.check("dev-a", &b), Ok(Pin::Replaced));
        let k = KnownDevices::new(&path, []);
        assert_eq!(k.check("dev-a", &b), Ok(Pin::Known));
        assert_eq!(k.check("dev-b", &b), Ok(Pin::Known));
        assert!(k.check("two words", &a).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
