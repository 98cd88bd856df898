//! Setup's peer sessions (direct forwarding): every worker connects to every other, the
//! links are measured, and the cost model's link is taken from them.

use loip_plan::LinkProfile;
use serde::Serialize;

use super::{DeviceReport, SessionOptions};
use crate::coordinator::{ClusterError, Conn};
use crate::net::direct::{PeerRef, PeersMsg};

/// A link from one worker to another, as setup found it.
#[derive(Debug, Clone, Serialize)]
pub struct PeerLinkStats {
    /// the other worker
    pub to: String,
    /// the peer session is up: hops from this worker to that one go direct
    pub reachable: bool,
    /// why not
    pub error: Option<String>,
    /// one-way latency (0: not measured)  // seconds
    pub latency_s: f64,
    /// bulk bandwidth towards `to` (0: not measured)  // bytes/s
    pub bps: f64,
}

/// Opens the peer sessions between every two of `conns` (index = peer device id) except the
/// pairs of `opts.relay_pairs`, measuring them with `opts.measure_links`; returns which
/// worker reaches which (`reach[from][to]`) and records the links in `reports`.
pub(super) async fn connect_peers(
    conns: &mut [Conn],
    opts: &SessionOptions,
    reports: &mut [DeviceReport],
) -> Result<Vec<Vec<bool>>, ClusterError> {
    let n = conns.len();
    let key = crate::wire::hex(&rand::random::<[u8; 32]>());
    let refs: Vec<PeerRef> = conns
        .iter()
        .enumerate()
        .map(|(i, c)| PeerRef {
            device: i as u16,
            name: c.endpoint.name.clone(),
            addr: c.endpoint.addr.clone(),
            key: crate::wire::hex(&c.device_key),
        })
        .collect();
    let relayed = |a: &str, b: &str| {
        opts.relay_pairs
            .iter()
            .any(|(x, y)| (x == a && y == b) || (x == b && y == a))
    };
    let others = |i: usize| -> Vec<PeerRef> {
        refs.iter()
            .filter(|r| r.device as usize != i && !relayed(&refs[i].name, &r.name))
            .cloned()
            .collect()
    };
    for (i, c) in conns.iter_mut().enumerate() {
        let msg = PeersMsg {
            key: key.clone(),
            me: i as u16,
            expect: others(i),
            connect: Vec::new(),
            measure: false,
        };
        c.peers(msg).await?;
    }
    let mut reach = vec![vec![false; n]; n];
    for (i, c) in conns.iter_mut().enumerate() {
        let msg = PeersMsg {
            key: key.clone(),
            me: i as u16,
            expect: others(i),
            connect: others(i),
            measure: opts.measure_links,
        };
        for l in c.peers(msg).await? {
            let j = l.device as usize;
            if j >= n {
                continue;
            }
            reach[i][j] = l.reachable;
            reports[i].peers.push(PeerLinkStats {
                to: refs[j].name.clone(),
                reachable: l.reachable,
                error: l.error,
                latency_s: l.latency_s,
                bps: l.bps,
            });
        }
        for j in (0..n).filter(|&j| j != i && relayed(&refs[i].name, &refs[j].name)) {
            reports[i].peers.push(PeerLinkStats {
                to: refs[j].name.clone(),
                reachable: false,
                error: Some("relayed by configuration".into()),
                latency_s: 0.0,
                bps: 0.0,
            });
        }
    }
    Ok(reach)
}

/// The cost model's link with direct forwarding: the slowest measured peer link (bandwidth)
/// and the largest peer latency; a pair that cannot reach each other counts as the star's
/// relayed hop. Without measured peer links, the star's figure.
pub fn direct_link(star: LinkProfile, reports: &[DeviceReport]) -> LinkProfile {
    let mut bw = f64::INFINITY;
    let mut lat: f64 = 0.0;
    let mut measured = false;
    for p in reports.iter().flat_map(|r| &r.peers) {
        if p.reachable && p.bps > 0.0 {
            measured = true;
            bw = bw.min(p.bps);
            lat = lat.max(p.latency_s);
        } else if !p.reachable {
            bw = bw.min(star.bandwidth);
            lat = lat.max(star.latency);
        }
    }
    if measured && bw.is_finite() {
        LinkProfile {
            bandwidth: bw,
            latency: lat,
        }
    } else {
        star
    }
}
