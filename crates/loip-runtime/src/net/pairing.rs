//! Pairing: how a coordinator and a new worker come to share the cluster's token from a short
//! code the worker prints, and the coordinator's own files.
//!
//! A worker running on the token it made itself prints a pairing code: [`CODE_CHARS`] base32
//! characters of HMAC-SHA256(token, "loip pairing code v1" ‖ its public key) (40 bits; it
//! reveals nothing of the token). `loip pair CODE` on the coordinator connects to the worker's
//! pairing port and runs SPAKE2 (the `spake2` crate, Ed25519 group) with the code as the
//! password, so that each connection is one guess of the code and a recorded or relayed
//! exchange gives no way to test guesses offline:
//!
//! ```text
//! C → W  "LOIPPAR1" ‖ SPAKE2 message A                       (33 bytes)
//! W → C  SPAKE2 message B ‖ sealed_w(name, public key)       the worker shows it holds the code
//! C → W  sealed_c(cluster token, coordinator's public key)   the coordinator shows it too
//! W → C  sealed_w("ok")                                      the worker saved the token
//! ```
//!
//! `sealed_x` is ChaCha20-Poly1305 under a key HKDF-SHA256 derives from SPAKE2's shared key,
//! one per direction, counter nonces, the two SPAKE2 messages as associated data; every sealed
//! message is at most [`MAX_SEALED`] bytes and every read has a deadline ([`IO_WAIT`]). The
//! worker then takes the coordinator's token (the coordinator's sessions and its peers'
//! handshakes use it) and pins the coordinator's static key (sessions from another
//! coordinator are refused until it is paired again), and the coordinator pins the worker's
//! key ([`crate::net::known`]), so only a paired device is ever used. A worker stops taking codes
//! after one pairing, after [`MAX_TRIES`] exchanges that did not end in one, or when its
//! pairing window ends. The threat model is in docs/cluster.md.
//!
//! The coordinator's files live in [`config_dir`]: `token` (the cluster token, mode 0600,
//! made on first pairing) and `known_devices` (the paired devices' keys).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::ChaCha20Poly1305;
use serde::{Deserialize, Serialize};

use crate::net::identity::KEY_BYTES;
use crate::RuntimeError;

/// Characters of a pairing code (base32: 5 bits each).
pub const CODE_CHARS: usize = 8;
/// Deadline of every read and write of an exchange.
pub const IO_WAIT: Duration = Duration::from_secs(5);
/// Exchanges a worker allows that do not end in a pairing (each is one guess of the code).
pub const MAX_TRIES: u32 = 10;
/// Largest sealed message, bytes.
pub const MAX_SEALED: usize = 1024;
const MAGIC: &[u8; 8] = b"LOIPPAR1";
const SPAKE_MSG: usize = 33;
const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";

fn invalid(m: impl Into<String>) -> RuntimeError {
    RuntimeError::Invalid(m.into())
}

/// The pairing code of a worker holding `token` with public key `key`.
pub fn code(token: &str, key: &[u8; KEY_BYTES]) -> String {
    use hmac::{Hmac, Mac};
    let mut mac = match <Hmac<sha2::Sha256> as Mac>::new_from_slice(token.as_bytes()) {
        Ok(m) => m,
        Err(_) => unreachable!("HMAC takes keys of any length"),
    };
    mac.update(b"loip pairing code v1");
    mac.update(key);
    let d = mac.finalize().into_bytes();
    // 40 bits: the first five bytes, five bits at a time
    let bits = d[..5].iter().fold(0u64, |acc, &b| (acc << 8) | b as u64);
    (0..CODE_CHARS)
        .map(|i| ALPHABET[((bits >> (35 - 5 * i)) & 31) as usize] as char)
        .collect()
}

/// A code as people read it: `ABCD-EFGH`.
pub fn display(code: &str) -> String {
    let (a, b) = code.split_at(code.len().min(4));
    format!("{a}-{b}")
}

/// A code as typed: case, spaces and dashes ignored; `0`/`1`/`8` read as `O`/`I`/`B`. Err:
/// not [`CODE_CHARS`] base32 characters.
pub fn normalize(typed: &str) -> Result<String, RuntimeError> {
    let c: String = typed
        .chars()
        .take(64)
        .filter(|c| !matches!(c, '-' | ' ' | '_'))
        .map(|c| match c.to_ascii_uppercase() {
            '0' => 'O',
            '1' => 'I',
            '8' => 'B',
            c => c,
        })
        .collect();
    if c.len() != CODE_CHARS || !c.bytes().all(|b| ALPHABET.contains(&b)) {
        return Err(invalid(format!(
            "{typed:.40}: a pairing code is {CODE_CHARS} letters and digits 2-7, as the worker \
             printed it (e.g. ABCD-EF23)"
        )));
    }
    Ok(c)
}

/// The coordinator's directory: `$LOIP_CONFIG_DIR`, else `$XDG_CONFIG_HOME/loip`, else
/// `$HOME/.config/loip`.
pub fn config_dir() -> Result<PathBuf, RuntimeError> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = var("LOIP_CONFIG_DIR") {
        return Ok(d);
    }
    if let Some(d) = var("XDG_CONFIG_HOME") {
        return Ok(d.join("loip"));
    }
    var("HOME")
        .map(|h| h.join(".config").join("loip"))
        .ok_or_else(|| invalid("no $HOME: set LOIP_CONFIG_DIR to the coordinator's directory"))
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> RuntimeError + '_ {
    move |e| RuntimeError::Io {
        path: path.to_path_buf(),
        source: e,
    }
}

/// Writes `text` to `path` (mode 0600) through a temporary file and a rename.
pub fn write_private(path: &Path, text: &str) -> Result<(), RuntimeError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io(&tmp))?;
    f.write_all(text.as_bytes()).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600)).map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// The cluster token in `dir/token`, made (mode 0600) when missing. The second value is true
/// when it was made now.
pub fn cluster_token(dir: &Path) -> Result<(String, bool), RuntimeError> {
    let path = dir.join(crate::net::token::STORE_TOKEN);
    if path.exists() {
        return Ok((crate::net::token::read_file(&path)?, false));
    }
    let t = crate::net::token::generate();
    write_private(&path, &format!("{t}\n"))?;
    Ok((t, true))
}

/// The keys pinned in a known-devices file, key → device name (a missing file: none).
pub fn pinned_keys(path: &Path) -> Result<HashMap<[u8; KEY_BYTES], String>, RuntimeError> {
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashMap::new()),
        Err(e) => return Err(io(path)(e)),
    };
    let mut text = String::new();
    f.take(1 << 20)
        .read_to_string(&mut text)
        .map_err(io(path))?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let name = w.next()?;
            let key = crate::net::session::unhex::<KEY_BYTES>(w.next()?)?;
            Some((key, name.to_string()))
        })
        .collect())
}

/// What a worker says of itself in an exchange.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Card {
    /// device name
    pub name: String,
    /// static public key, hex
    pub key: String,
}

/// The two directions' keys and the transcript of one exchange.
struct Sealer {
    to_worker: ChaCha20Poly1305,
    to_coordinator: ChaCha20Poly1305,
    transcript: Vec<u8>,
    sent: u64,
    received: u64,
}

impl Sealer {
    fn new(shared: &[u8], msg_a: &[u8], msg_b: &[u8]) -> Sealer {
        let hk = hkdf::Hkdf::<sha2::Sha256>::new(Some(b"loip pairing v1"), shared);
        let key = |info: &[u8]| {
            let mut k = [0u8; 32];
            // 32 bytes is within HKDF-SHA256's output bound
            let _ = hk.expand(info, &mut k);
            ChaCha20Poly1305::new(&k.into())
        };
        Sealer {
            to_worker: key(b"to worker"),
            to_coordinator: key(b"to coordinator"),
            transcript: [msg_a, msg_b].concat(),
            sent: 0,
            received: 0,
        }
    }

    fn nonce(n: u64) -> chacha20poly1305::Nonce {
        let mut b = [0u8; 12];
        b[4..].copy_from_slice(&n.to_be_bytes());
        b.into()
    }

    /// Seals `msg` for the other side (`worker`: this side is the worker).
    fn seal(&mut self, worker: bool, msg: &[u8]) -> Result<Vec<u8>, RuntimeError> {
        let k = if worker {
            &self.to_coordinator
        } else {
            &self.to_worker
        };
        let n = Self::nonce(self.sent);
        self.sent += 1;
        k.encrypt(
            &n,
            Payload {
                msg,
                aad: &self.transcript,
            },
        )
        .map_err(|_| invalid("sealing a pairing message"))
    }

    /// Opens a message from the other side; Err: the other side does not hold the code.
    fn open(&mut self, worker: bool, sealed: &[u8]) -> Result<Vec<u8>, RuntimeError> {
        let k = if worker {
            &self.to_worker
        } else {
            &self.to_coordinator
        };
        let n = Self::nonce(self.received);
        self.received += 1;
        k.decrypt(
            &n,
            Payload {
                msg: sealed,
                aad: &self.transcript,
            },
        )
        .map_err(|_| invalid("the pairing code does not match"))
    }
}

fn ids() -> (spake2::Identity, spake2::Identity) {
    (
        spake2::Identity::new(b"loip coordinator"),
        spake2::Identity::new(b"loip worker"),
    )
}

fn net(what: &'static str) -> impl Fn(std::io::Error) -> RuntimeError {
    move |e| invalid(format!("pairing: {what}: {e}"))
}

fn write_sealed(s: &mut TcpStream, sealed: &[u8]) -> Result<(), RuntimeError> {
    let len = u16::try_from(sealed.len()).map_err(|_| invalid("pairing message too long"))?;
    s.write_all(&len.to_be_bytes())
        .and_then(|_| s.write_all(sealed))
        .map_err(net("sending"))
}

fn read_sealed(s: &mut TcpStream) -> Result<Vec<u8>, RuntimeError> {
    let mut len = [0u8; 2];
    s.read_exact(&mut len).map_err(net("receiving"))?;
    let len = u16::from_be_bytes(len) as usize;
    if len > MAX_SEALED {
        return Err(invalid(format!(
            "pairing: a message of {len} bytes (at most {MAX_SEALED})"
        )));
    }
    let mut b = vec![0u8; len];
    s.read_exact(&mut b).map_err(net("receiving"))?;
    Ok(b)
}

fn deadlines(s: &TcpStream) -> Result<(), RuntimeError> {
    s.set_read_timeout(Some(IO_WAIT))
        .and_then(|_| s.set_write_timeout(Some(IO_WAIT)))
        .map_err(net("setting deadlines"))
}

/// The file in a worker's store holding the static public key of the coordinator it was
/// paired with (64 hex digits).
pub const COORDINATOR_PIN: &str = "coordinator_key";

/// The coordinator key a worker's `store` pins, if it was paired.
pub fn pinned_coordinator(store: &Path) -> Result<Option<[u8; KEY_BYTES]>, RuntimeError> {
    let path = store.join(COORDINATOR_PIN);
    match std::fs::read_to_string(&path) {
        Ok(t) => crate::net::session::unhex::<KEY_BYTES>(t.trim())
            .map(Some)
            .ok_or_else(|| invalid(format!("{}: not a key (64 hex digits)", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(RuntimeError::Io { path, source }),
    }
}

/// Pins `key` as the coordinator of the worker whose store is `store` (mode 0600).
pub fn pin_coordinator(store: &Path, key: &[u8; KEY_BYTES]) -> Result<(), RuntimeError> {
    write_private(
        &store.join(COORDINATOR_PIN),
        &format!("{}\n", crate::wire::hex(key)),
    )
}

/// What the coordinator hands a worker it pairs with.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Handover {
    /// the cluster token
    token: String,
    /// the coordinator's static public key (hex), which the worker pins
    key: String,
}

/// What a worker keeps from a pairing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paired {
    /// the cluster token
    pub token: String,
    /// the coordinator's static public key: sessions from another key are refused
    pub coordinator: [u8; KEY_BYTES],
}

/// Coordinator side: pairs with the worker taking codes at `addr`, giving it `token` and
/// this coordinator's static public key `me`. `expect_key`: the key its announcement
/// showed (refused if the worker proves another).
pub fn pair_with(
    addr: SocketAddr,
    code: &str,
    token: &str,
    me: &[u8; KEY_BYTES],
    expect_key: Option<&[u8; KEY_BYTES]>,
) -> Result<Card, RuntimeError> {
    let code = normalize(code)?;
    let mut s = TcpStream::connect_timeout(&addr, IO_WAIT).map_err(net("connecting"))?;
    deadlines(&s)?;
    let (id_a, id_b) = ids();
    let (state, msg_a) = spake2::Spake2::<spake2::Ed25519Group>::start_a(
        &spake2::Password::new(code.as_bytes()),
        &id_a,
        &id_b,
    );
    s.write_all(&[&MAGIC[..], &msg_a].concat())
        .map_err(net("sending"))?;
    let mut msg_b = [0u8; SPAKE_MSG];
    s.read_exact(&mut msg_b).map_err(|e| {
        invalid(format!(
            "pairing: {addr} did not answer the exchange ({e}): it may no longer take a code \
             (paired already, too many tries, or its pairing window ended: restart it with \
             --pair)"
        ))
    })?;
    let shared = state
        .finish(&msg_b)
        .map_err(|e| invalid(format!("pairing: a malformed answer: {e:?}")))?;
    let mut sealer = Sealer::new(&shared, &msg_a, &msg_b);
    let card = sealer.open(false, &read_sealed(&mut s)?).map_err(|_| {
        invalid(format!(
            "the pairing code {} is not the one the worker at {addr} printed",
            display(&code)
        ))
    })?;
    let card: Card = serde_json::from_slice(&card)
        .map_err(|e| invalid(format!("pairing: the worker's card: {e}")))?;
    let key = crate::net::session::unhex::<KEY_BYTES>(&card.key)
        .ok_or_else(|| invalid("pairing: the worker's key is not 64 hex digits"))?;
    if !crate::net::discovery::valid_name(&card.name) {
        return Err(invalid("pairing: the worker's name is not [A-Za-z0-9._-]"));
    }
    if let Some(k) = expect_key.filter(|&k| *k != key) {
        return Err(invalid(format!(
            "pairing: the worker at {addr} holds the code but shows key {}…, not the {}… it \
             announced",
            crate::wire::hex(&key[..8]),
            crate::wire::hex(&k[..8])
        )));
    }
    let handover = Handover {
        token: token.to_string(),
        key: crate::wire::hex(me),
    };
    let handover = serde_json::to_vec(&handover).map_err(|e| invalid(e.to_string()))?;
    let sealed = sealer.seal(false, &handover)?;
    write_sealed(&mut s, &sealed)?;
    let ok = sealer.open(false, &read_sealed(&mut s)?)?;
    if ok != b"ok" {
        return Err(invalid(format!(
            "pairing: the worker did not keep the token: {}",
            String::from_utf8_lossy(&ok)
                .chars()
                .take(200)
                .collect::<String>()
        )));
    }
    Ok(card)
}

/// One exchange on the worker's side. Ok(Some(paired)): paired (what it got was handed to
/// `keep`, and confirmed); Ok(None): not a pairing exchange (no guess was made).
fn answer(
    s: &mut TcpStream,
    code: &str,
    card: &Card,
    keep: &mut dyn FnMut(&Paired) -> Result<(), String>,
) -> Result<Option<Paired>, RuntimeError> {
    deadlines(s)?;
    let mut first = [0u8; 8 + SPAKE_MSG];
    if s.read_exact(&mut first).is_err() || &first[..8] != MAGIC {
        return Ok(None);
    }
    let msg_a = &first[8..];
    let (id_a, id_b) = ids();
    let (state, msg_b) = spake2::Spake2::<spake2::Ed25519Group>::start_b(
        &spake2::Password::new(code.as_bytes()),
        &id_a,
        &id_b,
    );
    let shared = state
        .finish(msg_a)
        .map_err(|e| invalid(format!("pairing: a malformed message: {e:?}")))?;
    let mut sealer = Sealer::new(&shared, msg_a, &msg_b);
    let card = serde_json::to_vec(card).map_err(|e| invalid(e.to_string()))?;
    let sealed = sealer.seal(true, &card)?;
    s.write_all(&msg_b).map_err(net("sending"))?;
    write_sealed(s, &sealed)?;
    let handover = sealer.open(true, &read_sealed(s)?)?;
    let handover: Handover = serde_json::from_slice(&handover)
        .map_err(|e| invalid(format!("pairing: the coordinator's handover: {e}")))?;
    crate::net::token::check(&handover.token, "the coordinator")?;
    let coordinator = crate::net::session::unhex::<KEY_BYTES>(&handover.key)
        .ok_or_else(|| invalid("pairing: the coordinator's key is not 64 hex digits"))?;
    let paired = Paired {
        token: handover.token,
        coordinator,
    };
    let reply = match keep(&paired) {
        Ok(()) => b"ok".to_vec(),
        Err(e) => e.into_bytes(),
    };
    let sealed = sealer.seal(true, &reply)?;
    write_sealed(s, &sealed)?;
    Ok((reply == b"ok").then_some(paired))
}

/// How a worker's pairing ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    /// paired: the token it keeps now and the coordinator it pins
    Paired(Paired),
    /// [`MAX_TRIES`] exchanges did not pair
    TooManyTries,
    /// the window ended
    WindowOver,
}

/// Worker side: answers exchanges on `listener` with `code` until one pairs (its token is
/// given to `keep`, which saves it), [`MAX_TRIES`] fail, or `window` ends. `log`: a line per
/// exchange for the worker's log.
pub fn serve(
    listener: TcpListener,
    code: &str,
    card: &Card,
    window: Duration,
    mut keep: impl FnMut(&Paired) -> Result<(), String>,
    mut log: impl FnMut(&str),
) -> Result<Ended, RuntimeError> {
    listener
        .set_nonblocking(true)
        .map_err(net("the pairing port"))?;
    let end = Instant::now() + window;
    let mut tries = 0;
    while Instant::now() < end {
        let (mut s, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
            Err(e) => {
                log(&format!("pairing: accept: {e}"));
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let _ = s.set_nonblocking(false);
        match answer(&mut s, code, card, &mut keep) {
            Ok(Some(paired)) => {
                log(&format!(
                    "paired with the coordinator at {peer} (key {}…, pinned: sessions from \
                     another coordinator are refused until `loip worker --pair` pairs again)",
                    crate::wire::hex(&paired.coordinator[..8])
                ));
                return Ok(Ended::Paired(paired));
            }
            Ok(None) => log(&format!(
                "pairing: {peer} did not speak the pairing exchange"
            )),
            Err(e) => {
                tries += 1;
                log(&format!(
                    "pairing: {peer}: {e} ({tries} of {MAX_TRIES} tries used)"
                ));
                if tries >= MAX_TRIES {
                    return Ok(Ended::TooManyTries);
                }
            }
        }
    }
    Ok(Ended::WindowOver)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_short_stable_and_typed_loosely() {
        let c = code("t".repeat(64).as_str(), &[3; 32]);
        assert_eq!(c.len(), CODE_CHARS);
        assert_eq!(c, code("t".repeat(64).as_str(), &[3; 32]));
        assert_ne!(c, code("u".repeat(64).as_str(), &[3; 32]));
        assert_ne!(c, code("t".repeat(64).as_str(), &[4; 32]));
        assert_eq!(normalize(&display(&c).to_lowercase()).unwrap(), c);
        assert!(normalize("ABCD").is_err());
        assert!(normalize("ABCD-EFG9").is_err());
        assert!(normalize(&"A".repeat(10_000)).is_err());
    }

    fn worker(code: String, window: Duration) -> (SocketAddr, std::thread::JoinHandle<Ended>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let card = Card {
            name: "w1".into(),
            key: crate::wire::hex(&[9; 32]),
        };
        let h =
            std::thread::spawn(move || serve(l, &code, &card, window, |_| Ok(()), |_| {}).unwrap());
        (addr, h)
    }

    #[test]
    fn the_right_code_hands_over_the_token_and_a_wrong_one_does_not() {
        let token = "c".repeat(64);
        let code = code("w".repeat(64).as_str(), &[9; 32]);
        let (addr, h) = worker(code.clone(), Duration::from_secs(20));
        let wrong = if code.starts_with('A') {
            "BBBBBBBB"
        } else {
            "AAAAAAAA"
        };
        let e = pair_with(addr, wrong, &token, &[5; 32], None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not the one the worker"), "{e}");
        // garbage is not a guess and does not panic the worker
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&[0xff; 41]).unwrap();
        drop(s);
        let card = pair_with(addr, &code, &token, &[5; 32], Some(&[9; 32])).unwrap();
        assert_eq!(card.name, "w1");
        assert_eq!(
            h.join().unwrap(),
            Ended::Paired(Paired {
                token,
                coordinator: [5; 32]
            })
        );
    }

    #[test]
    fn a_worker_stops_after_too_many_tries() {
        let code = code("w".repeat(64).as_str(), &[9; 32]);
        let (addr, h) = worker(code.clone(), Duration::from_secs(60));
        let wrong = if code.starts_with('A') {
            "BBBBBBBB"
        } else {
            "AAAAAAAA"
        };
        for _ in 0..MAX_TRIES {
            assert!(pair_with(addr, wrong, &"c".repeat(64), &[5; 32], None).is_err());
        }
        assert_eq!(h.join().unwrap(), Ended::TooManyTries);
        assert!(pair_with(addr, &code, &"c".repeat(64), &[5; 32], None).is_err());
    }
}
