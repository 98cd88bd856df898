//! A device's static key pair: the X25519 key a worker proves in every Noise handshake
//! ([`crate::net::handshake`]), so that the coordinator can pin it and a peer session names
//! the device it comes from.
//!
//! A worker keeps its pair in its store as [`STORE_KEY`] (the private key, 64 hex characters
//! and a newline, mode 0600, created on first start, never a link); the public key's hex is
//! its fingerprint. A coordinator makes a fresh pair per process: workers do not pin it (any
//! holder of the token may coordinate).

use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::RuntimeError;

/// File name of a worker's private key inside its store.
pub const STORE_KEY: &str = "device_key";
/// Bytes of an X25519 key.
pub const KEY_BYTES: usize = 32;

/// A static X25519 key pair.
#[derive(Clone)]
pub struct Identity {
    private: [u8; KEY_BYTES],
    public: [u8; KEY_BYTES],
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // never the private key
        write!(f, "Identity({})", self.fingerprint())
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> RuntimeError + '_ {
    move |e| RuntimeError::Io {
        path: path.to_path_buf(),
        source: e,
    }
}

impl Identity {
    /// A fresh pair from the operating system's random source.
    pub fn generate() -> Identity {
        Identity::from_private(rand::random())
    }

    /// The pair of a private key (clamped by X25519 itself).
    pub fn from_private(private: [u8; KEY_BYTES]) -> Identity {
        let public = x25519_dalek::x25519(private, x25519_dalek::X25519_BASEPOINT_BYTES);
        Identity { private, public }
    }

    /// The private key (for the handshake only).
    pub(crate) fn private(&self) -> &[u8; KEY_BYTES] {
        &self.private
    }

    /// The public key.
    pub fn public(&self) -> [u8; KEY_BYTES] {
        self.public
    }

    /// The public key in hex: what the coordinator pins and prints.
    pub fn fingerprint(&self) -> String {
        crate::wire::hex(&self.public)
    }

    /// The pair kept in `store` ([`STORE_KEY`]), created (mode 0600) when missing. The
    /// second value is true when it was created now. A key file that others may read, that
    /// is not a regular file, or that does not hold a key is refused.
    pub fn load_or_create(store: &Path) -> Result<(Identity, bool), RuntimeError> {
        let path = store.join(STORE_KEY);
        match std::fs::symlink_metadata(&path) {
            Ok(_) => return Ok((Identity::load(&path)?, false)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(&path)(e)),
        }
        std::fs::create_dir_all(store).map_err(io(store))?;
        let id = Identity::generate();
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(io(&path))?;
        writeln!(f, "{}", crate::wire::hex(&id.private)).map_err(io(&path))?;
        f.sync_all().map_err(io(&path))?;
        Ok((id, true))
    }

    fn load(path: &Path) -> Result<Identity, RuntimeError> {
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .map_err(io(path))?;
        let m = f.metadata().map_err(io(path))?;
        let bad = |why: String| RuntimeError::Invalid(format!("{}: {why}", path.display()));
        if !m.is_file() {
            return Err(bad("not a regular file".into()));
        }
        if m.permissions().mode() & 0o077 != 0 {
            return Err(bad(format!(
                "the device key can be read by other users; chmod 600 {}",
                path.display()
            )));
        }
        let mut text = String::new();
        (&mut f)
            .take(256)
            .read_to_string(&mut text)
            .map_err(io(path))?;
        let private = crate::net::session::unhex::<KEY_BYTES>(text.trim())
            .ok_or_else(|| bad("does not hold a device key (64 hex characters)".into()))?;
        Ok(Identity::from_private(private))
    }
}

/// Where a worker keeps its key.
pub fn store_key_path(store: &Path) -> PathBuf {
    store.join(STORE_KEY)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_makes_and_keeps_its_key() {
        let dir = std::env::temp_dir().join(format!("loip-identity-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (a, made) = Identity::load_or_create(&dir).unwrap();
        assert!(made);
        let path = store_key_path(&dir);
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let (b, made) = Identity::load_or_create(&dir).unwrap();
        assert!(!made);
        assert_eq!(a.public(), b.public());
        assert!(!format!("{a:?}").contains(&crate::wire::hex(a.private())));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Identity::load_or_create(&dir).unwrap_err().to_string();
        assert!(e.contains("chmod 600"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
