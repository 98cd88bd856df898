//! `--peer-allow CIDR`: the networks a worker accepts connections from (coordinators and
//! peers alike). A connection from elsewhere is closed at accept, before the handshake takes
//! a slot. An IPv4 address mapped into IPv6 (`::ffff:a.b.c.d`) is checked as the IPv4 one.

use std::net::IpAddr;
use std::str::FromStr;

/// A network: an address and a prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl FromStr for Cidr {
    type Err = String;

    /// `a.b.c.d/n`, `x:y::z/n`, or a bare address (one host).
    fn from_str(s: &str) -> Result<Cidr, String> {
        let bad =
            |why: &str| format!("--peer-allow {s:.60}: {why} (e.g. 10.0.0.0/24 or fd00::/64)");
        let (a, p) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = a.trim().parse().map_err(|_| bad("not an IP address"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match p {
            None => max,
            Some(p) => p
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|&n| n <= max)
                .ok_or_else(|| bad("the prefix length is not 0 to 32 (IPv4) or 128 (IPv6)"))?,
        };
        Ok(Cidr { addr, prefix })
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

fn unmapped(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v) => v.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

impl Cidr {
    /// Whether `ip` lies in this network.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, unmapped(ip)) {
            (IpAddr::V4(n), IpAddr::V4(a)) => same_prefix(&n.octets(), &a.octets(), self.prefix),
            (IpAddr::V6(n), IpAddr::V6(a)) => same_prefix(&n.octets(), &a.octets(), self.prefix),
            _ => false,
        }
    }
}

fn same_prefix(n: &[u8], a: &[u8], prefix: u8) -> bool {
    let (whole, rest) = ((prefix / 8) as usize, prefix % 8);
    if n[..whole] != a[..whole] {
        return false;
    }
    if rest == 0 {
        return true;
    }
    let mask = 0xffu8 << (8 - rest);
    (n[whole] & mask) == (a[whole] & mask)
}

/// Whether a connection from `ip` is let in: `allow` is empty, or one of its networks holds it.
pub fn allowed(allow: &[Cidr], ip: IpAddr) -> bool {
    allow.is_empty() || allow.iter().any(|c| c.contains(ip))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn networks_hold_their_addresses_only() {
        let n: Cidr = "10.1.2.0/23".parse().unwrap();
        assert!(n.contains(ip("10.1.3.255")) && n.contains(ip("10.1.2.0")));
        assert!(!n.contains(ip("10.1.4.0")) && !n.contains(ip("fd00::1")));
        assert!(n.contains(ip("::ffff:10.1.2.9")));
        let one: Cidr = "127.0.0.2".parse().unwrap();
        assert!(one.contains(ip("127.0.0.2")) && !one.contains(ip("127.0.0.1")));
        let v6: Cidr = "fd00::/8".parse().unwrap();
        assert!(v6.contains(ip("fd12::1")) && !v6.contains(ip("fe80::1")));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(ip("8.8.8.8")));
        for bad in ["10.0.0.0/33", "fd00::/129", "host/8", "10.0.0.0/x", ""] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
        assert!(allowed(&[], ip("1.2.3.4")));
        assert!(!allowed(&[n], ip("1.2.3.4")));
    }
}
