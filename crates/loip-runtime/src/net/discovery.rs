//! Workers on the LAN: a worker announces itself with DNS-SD over multicast DNS (service
//! [`SERVICE`], the `mdns-sd` crate), and a coordinator browses for a few seconds.
//!
//! An announcement's TXT record holds the device's name (`name`), the wire protocol version
//! (`v`), its memory budget (`mem`, bytes), its static public key (`key`, 64 hex characters:
//! the fingerprint a coordinator pins) and, while it takes a pairing code, the TCP port of its
//! pairing exchange (`pair`, see [`crate::net::pairing`]). Never the token, nor anything
//! derived from it.
//!
//! Everything in an answer is hostile input: [`parse`] takes only the keys above, bounds every
//! value, accepts only `[A-Za-z0-9._-]` names of at most [`MAX_NAME`] characters and a key of
//! exactly 64 hex digits; [`browse`] keeps at most `max` devices. An announcement only says
//! where a device claims to be: a coordinator uses a device only when its key is pinned
//! (paired), and the Noise handshake proves that key before anything else is said.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use crate::net::identity::KEY_BYTES;
use crate::RuntimeError;

/// The DNS-SD service type of loip workers.
pub const SERVICE: &str = "_loip._tcp.local.";
/// Longest device name taken from an announcement, characters.
pub const MAX_NAME: usize = 63;
/// Most addresses kept per device.
const MAX_ADDRS: usize = 8;

/// What a worker announces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announcement {
    /// device name (also the DNS-SD instance name)
    pub name: String,
    /// port of its sessions
    pub port: u16,
    /// memory budget  // bytes
    pub mem: u64,
    /// static public key
    pub key: [u8; KEY_BYTES],
    /// port of its pairing exchange, while it takes a pairing code
    pub pair_port: Option<u16>,
}

/// A device that answered a browse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// device name (checked: `[A-Za-z0-9._-]`, at most [`MAX_NAME`] characters)
    pub name: String,
    /// its addresses, IPv4 first
    pub addrs: Vec<IpAddr>,
    /// port of its sessions
    pub port: u16,
    /// wire protocol version it speaks
    pub version: u32,
    /// memory budget it announced  // bytes
    pub mem: Option<u64>,
    /// static public key it announced (proved only by a handshake)
    pub key: [u8; KEY_BYTES],
    /// port of its pairing exchange, while it takes a pairing code
    pub pair_port: Option<u16>,
}

impl Found {
    /// `host:port` of its sessions on its first address (IPv6 in brackets).
    pub fn session_addr(&self) -> Option<String> {
        self.addr_with(self.port)
    }

    /// `host:port` of its pairing exchange, while it takes a code.
    pub fn pair_addr(&self) -> Option<String> {
        self.pair_port.and_then(|p| self.addr_with(p))
    }

    /// `host:port` of its sessions on the first of its announced addresses (IPv4 first, then
    /// IPv6) that accepts a TCP connection within `wait`; with one address, that one
    /// untried. `None` when none answers.
    pub fn answering_session_addr(&self, wait: std::time::Duration) -> Option<String> {
        let addrs: Vec<std::net::SocketAddr> = self
            .addrs
            .iter()
            .map(|ip| std::net::SocketAddr::new(*ip, self.port))
            .collect();
        if addrs.len() == 1 {
            return addrs.first().map(|a| a.to_string());
        }
        addrs
            .into_iter()
            .find(|a| std::net::TcpStream::connect_timeout(a, wait).is_ok())
            .map(|a| a.to_string())
    }

    fn addr_with(&self, port: u16) -> Option<String> {
        let ip = self.addrs.first()?;
        Some(std::net::SocketAddr::new(*ip, port).to_string())
    }

    /// Its key's short form, for people.
    pub fn short_key(&self) -> String {
        crate::wire::hex(&self.key[..8])
    }
}

/// Whether `name` is a device name an announcement may carry.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The TXT properties of an announcement.
pub fn txt(a: &Announcement) -> Vec<(String, String)> {
    let mut p = vec![
        ("name".to_string(), a.name.clone()),
        ("v".to_string(), crate::wire::PROTOCOL_VERSION.to_string()),
        ("mem".to_string(), a.mem.to_string()),
        ("key".to_string(), crate::wire::hex(&a.key)),
    ];
    if let Some(port) = a.pair_port {
        p.push(("pair".to_string(), port.to_string()));
    }
    p
}

/// A device from an answer's TXT properties (`(key, value)`), port and addresses. Err: why
/// the answer is not a loip worker's (for a log line, bounded).
pub fn parse<'a>(
    props: impl IntoIterator<Item = (&'a str, &'a str)>,
    port: u16,
    addrs: impl IntoIterator<Item = IpAddr>,
) -> Result<Found, String> {
    let (mut name, mut version, mut mem, mut key, mut pair) = (None, None, None, None, None);
    for (k, v) in props {
        let v = (v.len() <= 255).then_some(v);
        match k {
            "name" => name = v.map(str::to_string),
            "v" => version = v.and_then(|v| v.parse::<u32>().ok()),
            "mem" => mem = v.and_then(|v| v.parse::<u64>().ok()),
            "key" => key = v.and_then(crate::net::session::unhex::<KEY_BYTES>),
            "pair" => pair = v.and_then(|v| v.parse::<u16>().ok()).filter(|&p| p != 0),
            _ => {}
        }
    }
    let name = name.ok_or("no device name")?;
    if !valid_name(&name) {
        return Err(format!(
            "device name {:?} is not [A-Za-z0-9._-], at most {MAX_NAME} characters",
            name.chars().take(MAX_NAME + 1).collect::<String>()
        ));
    }
    let version = version.ok_or("no protocol version")?;
    let key = key.ok_or("no device key (64 hex digits)")?;
    if port == 0 {
        return Err("port 0".into());
    }
    let mut addrs: Vec<IpAddr> = addrs
        .into_iter()
        .filter(|ip| !ip.is_unspecified() && !ip.is_multicast())
        .filter(|ip| match ip {
            // link-local IPv6 needs a scope a socket address string cannot carry here
            IpAddr::V6(v) => (v.segments()[0] & 0xffc0) != 0xfe80,
            IpAddr::V4(_) => true,
        })
        .take(64)
        .collect();
    addrs.sort_by_key(|ip| (ip.is_ipv6(), *ip));
    addrs.dedup();
    addrs.truncate(MAX_ADDRS);
    if addrs.is_empty() {
        return Err(NO_ADDRESS.into());
    }
    Ok(Found {
        name,
        addrs,
        port,
        version,
        mem,
        key,
        pair_port: pair,
    })
}

fn mdns_err(what: &str, e: mdns_sd::Error) -> RuntimeError {
    RuntimeError::Invalid(format!("multicast DNS: {what}: {e}"))
}

/// A worker's announcement, withdrawn when dropped.
pub struct Announcer {
    daemon: mdns_sd::ServiceDaemon,
    fullname: Option<String>,
}

impl Announcer {
    /// Starts the responder (nothing announced yet).
    pub fn new() -> Result<Announcer, RuntimeError> {
        let daemon = mdns_sd::ServiceDaemon::new().map_err(|e| mdns_err("starting", e))?;
        Ok(Announcer {
            daemon,
            fullname: None,
        })
    }

    /// Announces `a` on every interface, replacing what was announced (registering the same
    /// instance again updates it: withdrawing it first would make the responder see its own
    /// name as taken and announce `NAME (2)`).
    pub fn announce(&mut self, a: &Announcement) -> Result<(), RuntimeError> {
        if !valid_name(&a.name) {
            return Err(RuntimeError::Invalid(format!(
                "device name {:?} cannot be announced: use [A-Za-z0-9._-], at most {MAX_NAME} \
                 characters (--name)",
                a.name
            )));
        }
        let props: Vec<(String, String)> = txt(a);
        let props: Vec<(&str, &str)> = props.iter().map(|(k, v)| (&**k, &**v)).collect();
        let host = format!("{}.local.", a.name);
        let info = mdns_sd::ServiceInfo::new(SERVICE, &a.name, &host, "", a.port, &props[..])
            .map_err(|e| mdns_err("the announcement", e))?
            .enable_addr_auto();
        let fullname = info.get_fullname().to_string();
        if self.fullname.as_ref() != Some(&fullname) {
            self.withdraw();
        }
        self.daemon
            .register(info)
            .map_err(|e| mdns_err("announcing", e))?;
        self.fullname = Some(fullname);
        Ok(())
    }

    fn withdraw(&mut self) {
        if let Some(f) = self.fullname.take() {
            if let Ok(rx) = self.daemon.unregister(&f) {
                let _ = rx.recv_timeout(Duration::from_secs(1));
            }
        }
    }
}

impl Drop for Announcer {
    fn drop(&mut self) {
        self.withdraw();
        let _ = self.daemon.shutdown();
    }
}

/// The devices that answer within `wait`, at most `max`, by name; answers that are not a
/// loip worker's are passed to `skipped` with why. An answer whose address records carried
/// no usable address yet (only link-local IPv6, say, with its IPv4 record still to come) is
/// kept and its host name resolved within the same `wait`, rather than dropped.
pub fn browse(
    wait: Duration,
    max: usize,
    mut skipped: impl FnMut(&str, &str),
) -> Result<Vec<Found>, RuntimeError> {
    let daemon = mdns_sd::ServiceDaemon::new().map_err(|e| mdns_err("starting", e))?;
    let rx = daemon
        .browse(SERVICE)
        .map_err(|e| mdns_err("browsing", e))?;
    let end = Instant::now() + wait;
    let mut found: BTreeMap<String, Found> = BTreeMap::new();
    // answers waiting for a usable address: (who, TXT properties, port, host's resolution)
    let mut pending: Vec<Pending> = Vec::new();
    let keep = |f: Found, found: &mut BTreeMap<String, Found>| {
        if found.contains_key(&f.name) || found.len() < max {
            found.insert(f.name.clone(), f);
            None
        } else {
            Some(f.name)
        }
    };
    while let Some(left) = end.checked_duration_since(Instant::now()) {
        pending.retain_mut(|p| match p.addresses() {
            None => true,
            Some(addrs) => match parse(p.props(), p.port, addrs) {
                Ok(f) => {
                    if let Some(n) = keep(f, &mut found) {
                        skipped(&n, "more devices than this browse keeps");
                    }
                    false
                }
                Err(_) => true,
            },
        });
        let slice = if pending.is_empty() {
            left
        } else {
            left.min(PENDING_POLL)
        };
        let ev = match rx.recv_timeout(slice) {
            Ok(ev) => ev,
            Err(mdns_sd::RecvTimeoutError::Timeout) => continue,
            Err(mdns_sd::RecvTimeoutError::Disconnected) => break,
        };
        let mdns_sd::ServiceEvent::ServiceResolved(s) = ev else {
            continue;
        };
        let props: Vec<(String, String)> = s
            .txt_properties
            .iter()
            .map(|p| (p.key().to_string(), p.val_str().to_string()))
            .take(32)
            .collect();
        let addrs = s.addresses.iter().map(|a| a.to_ip_addr());
        let who = s.fullname.chars().take(80).collect::<String>();
        match parse(props.iter().map(|(k, v)| (&**k, &**v)), s.port, addrs) {
            Ok(f) => {
                if let Some(n) = keep(f, &mut found) {
                    skipped(&n, "more devices than this browse keeps");
                }
            }
            Err(why) if why == NO_ADDRESS && pending.len() < MAX_PENDING => {
                let ms = left.as_millis().min(u64::MAX as u128) as u64;
                match daemon.resolve_hostname(&s.host, Some(ms.max(1))) {
                    Ok(rx) => pending.push(Pending {
                        who,
                        props,
                        port: s.port,
                        rx,
                    }),
                    Err(_) => skipped(&who, &why),
                }
            }
            Err(why) => skipped(&who, &why),
        }
    }
    for p in pending {
        // unless it answered again with an address meanwhile
        let any = IpAddr::from([127, 0, 0, 1]);
        let name = parse(p.props(), p.port, [any]).map(|f| f.name);
        if !name.is_ok_and(|n| found.contains_key(&n)) {
            skipped(&p.who, NO_ADDRESS);
        }
    }
    let _ = daemon.shutdown();
    Ok(found.into_values().collect())
}

/// Why an answer without a usable address is refused ([`parse`]).
const NO_ADDRESS: &str = "no usable address";
/// Answers at most waiting for their host's addresses in one browse.
const MAX_PENDING: usize = 64;
/// How often a browse with answers waiting looks at their resolutions.
const PENDING_POLL: Duration = Duration::from_millis(50);

/// An answer that came before a usable address record, and its host name's resolution.
struct Pending {
    who: String,
    props: Vec<(String, String)>,
    port: u16,
    rx: mdns_sd::Receiver<mdns_sd::HostnameResolutionEvent>,
}

impl Pending {
    fn props(&self) -> impl Iterator<Item = (&str, &str)> {
        self.props.iter().map(|(k, v)| (&**k, &**v))
    }

    /// The addresses its host resolved to since the last look, if any.
    fn addresses(&self) -> Option<Vec<IpAddr>> {
        let mut got: Option<Vec<IpAddr>> = None;
        while let Ok(ev) = self.rx.try_recv() {
            if let mdns_sd::HostnameResolutionEvent::AddressesFound(_, a) = ev {
                got.get_or_insert_with(Vec::new)
                    .extend(a.iter().map(|a| a.to_ip_addr()).take(64));
            }
        }
        got
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props(a: &Announcement) -> Vec<(String, String)> {
        txt(a)
    }

    #[test]
    fn an_announcement_round_trips_and_never_holds_a_token() {
        let a = Announcement {
            name: "w1".into(),
            port: 7001,
            mem: 1 << 30,
            key: [7; 32],
            pair_port: Some(40000),
        };
        let p = props(&a);
        assert!(p
            .iter()
            .all(|(k, _)| ["name", "v", "mem", "key", "pair"].contains(&&**k)));
        let ip: IpAddr = "10.0.0.2".parse().unwrap();
        let f = parse(p.iter().map(|(k, v)| (&**k, &**v)), 7001, [ip]).unwrap();
        assert_eq!(f.name, "w1");
        assert_eq!(f.key, [7; 32]);
        assert_eq!(f.mem, Some(1 << 30));
        assert_eq!(f.session_addr().as_deref(), Some("10.0.0.2:7001"));
        assert_eq!(f.pair_addr().as_deref(), Some("10.0.0.2:40000"));
    }

    #[test]
    fn hostile_answers_are_refused_or_bounded() {
        let ip: IpAddr = "10.0.0.2".parse().unwrap();
        let key = crate::wire::hex(&[1; 32]);
        let ok = |name: &str| parse([("name", name), ("v", "7"), ("key", &*key)], 7001, [ip]);
        assert!(ok("w-1.a_b").is_ok());
        for bad in ["", "../x", ".hidden", "a b", "ä", &"x".repeat(64), "a\0b"] {
            assert!(ok(bad).is_err(), "{bad:?}");
        }
        let long = "f".repeat(10_000);
        for (k, v) in [("key", "00"), ("key", &*long), ("v", "-1"), ("v", &*long)] {
            let mut p = vec![("name", "w1"), ("v", "7"), ("key", &*key)];
            p.retain(|(pk, _)| *pk != k);
            p.push((k, v));
            assert!(parse(p, 7001, [ip]).is_err(), "{k}={v:.20}");
        }
        let p = [("name", "w1"), ("v", "7"), ("key", &*key), ("pair", "0")];
        assert_eq!(parse(p, 7001, [ip]).unwrap().pair_port, None);
        assert!(parse([("name", "w1"), ("v", "7"), ("key", &*key)], 0, [ip]).is_err());
        let many = (0..1000u32).map(|i| IpAddr::from(std::net::Ipv4Addr::from(i + 1)));
        let f = parse([("name", "w1"), ("v", "7"), ("key", &*key)], 1, many).unwrap();
        assert!(f.addrs.len() <= MAX_ADDRS);
        let ll: IpAddr = "fe80::1".parse().unwrap();
        assert!(parse([("name", "w1"), ("v", "7"), ("key", &*key)], 1, [ll]).is_err());
    }
}
