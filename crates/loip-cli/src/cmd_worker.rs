//! `loip worker`: run this machine as one device of a cluster. It announces itself on the
//! LAN ([`loip_runtime::net::discovery`]) and, while it runs on the token it made itself,
//! takes a pairing code ([`loip_runtime::net::pairing`]): a coordinator that pairs hands it
//! the cluster's token, which it keeps in its store and serves with from then on.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use loip_runtime::net::token;
use loip_runtime::net::{discovery, pairing};
use loip_runtime::worker::{exit_when_parent_dies, Worker, WorkerOptions};

/// Arguments of `loip worker`.
#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// Address to listen on; port 0 picks a free port (the first stdout line says which).
    #[arg(long, default_value = "0.0.0.0:7001")]
    pub listen: String,
    /// Memory budget of this device, e.g. `2GiB`: the most the whole worker process may be
    /// charged, as the kernel counts it (page cache and kernel buffers included). The engine
    /// (weights, slot, KV cache) gets what the process itself does not need; both are
    /// printed at start. Default: the device's — the smaller of this process's memory cgroup
    /// limit and MemAvailable, less a margin of 5 % (at least 8 MiB).
    #[arg(long)]
    pub mem: Option<String>,
    /// Slice store: the slices this device was given, kept and reused across restarts (also
    /// its key and token). Default: `worker-store` in the cache directory (`$LOIP_CACHE`, else
    /// `$XDG_CACHE_HOME/loip`, else `~/.cache/loip`).
    #[arg(long)]
    pub store: Option<PathBuf>,
    /// Most bytes of slices the store may hold, e.g. `20GiB`; a coordinator sending more is
    /// refused before a byte is written. Default: what the store holds plus the free space
    /// of its disk, less 5 % of the disk.
    #[arg(long, value_name = "BYTES")]
    pub store_quota: Option<String>,
    /// File holding the shared secret the coordinator must prove (first line; mode 0600, a
    /// file others may read is refused). Default: `$LOIP_TOKEN`; else, off loopback,
    /// `STORE/token`, created on first start (its path is printed, never the token). Without
    /// any, only a loopback address is allowed.
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// The shared secret itself (visible to other users in `ps`: prefer --token-file or
    /// `$LOIP_TOKEN`).
    #[arg(long)]
    pub token: Option<String>,
    /// End an authenticated session that receives nothing for this many seconds (the
    /// coordinator sends a keepalive every 10 s).
    #[arg(long, default_value_t = 60)]
    pub idle_timeout: u64,
    /// Name reported to the coordinator (default: worker@ADDR).
    #[arg(long)]
    pub name: Option<String>,
    /// Emulate an outgoing link limit, e.g. `100mbit`.
    #[arg(long)]
    pub bandwidth: Option<String>,
    /// Accept connections (coordinators and peer workers) only from this network, e.g.
    /// `10.0.0.0/24` or `fd00::/64` (repeatable; default: from anywhere). Others are closed at
    /// accept.
    #[arg(long, value_name = "CIDR")]
    pub peer_allow: Vec<String>,
    /// Take a pairing code even though this worker was paired before (a coordinator that
    /// pairs replaces the token it holds).
    #[arg(long)]
    pub pair: bool,
    /// How long the worker takes a pairing code after it starts, e.g. `600s`.
    #[arg(long, default_value = "600s", value_parser = crate::backend::parse_retry)]
    pub pair_window: std::time::Duration,
    /// Do not announce this worker on the LAN (multicast DNS); coordinators then need a
    /// cluster file naming its address.
    #[arg(long)]
    pub no_announce: bool,
    /// Exit when the parent process exits (used by `loip local`).
    #[arg(long, hide = true)]
    pub exit_with_parent: bool,
}

/// File in a worker's store saying that a coordinator paired it.
const PAIRED: &str = "paired";

/// `loip worker`.
pub fn run(mut a: WorkerArgs) -> Result<()> {
    let store = a
        .store
        .clone()
        .unwrap_or_else(|| loip_model::fetch::cache_dir().join("worker-store"));
    loip_runtime::memory::return_freed_memory();
    let mem = match &a.mem {
        Some(m) => loip_plan::parse_bytes(m).with_context(|| format!("--mem {m}"))?,
        None => {
            let d = loip_runtime::memory::default_budget().context(
                "no --mem, and neither a cgroup memory limit nor MemAvailable could be read; give --mem",
            )?;
            eprintln!(
                "budget {} (no --mem): {}",
                loip_plan::units::format_bytes(d.bytes),
                d.why
            );
            d.bytes
        }
    };
    if a.token.is_some() {
        eprintln!(
            "warning: --token is visible to other users in `ps`; prefer --token-file or LOIP_TOKEN"
        );
    }
    let given = token::from_sources(a.token_file.as_deref(), a.token.as_deref())?;
    let own_token = given.is_none();
    let (tok, created) = token::for_worker(given, &a.listen, &store)?;
    match (&tok, created) {
        (Some(_), Some(path)) => eprintln!(
            "generated a token for this worker in {} (mode 0600); pair it with the code below, \
             or give the coordinator a copy of that file with --token-file FILE",
            path.display()
        ),
        (None, _) => eprintln!(
            "no token: any coordinator that can reach {} may connect (loopback only)",
            a.listen
        ),
        _ => {}
    }
    let (id, made) = loip_runtime::net::identity::Identity::load_or_create(&store)?;
    eprintln!(
        "device key {} ({} in {}; coordinators pin it)",
        id.fingerprint(),
        if made { "new" } else { "kept" },
        store.display()
    );
    let peer_allow = (a.peer_allow.iter().map(|c| c.parse()))
        .collect::<Result<Vec<_>, String>>()
        .map_err(anyhow::Error::msg)?;
    let mut opts = WorkerOptions::new(a.listen.clone(), mem, store.clone()).whole_process()?;
    opts.peer_allow = peer_allow;
    eprintln!("{}", opts.budget());
    opts.token = tok;
    // paired: on the store's token, only the coordinator it was paired with is served
    if own_token {
        opts.coordinator_key = pairing::pinned_coordinator(&store)?;
        if let Some(k) = &opts.coordinator_key {
            eprintln!(
                "serving the coordinator paired with (key {}…) alone; `--pair` pairs again",
                loip_runtime::wire::hex(&k[..8])
            );
        }
    }
    opts.idle_timeout = std::time::Duration::from_secs(a.idle_timeout.max(1));
    opts.name = a.name.take();
    opts.store_quota = a
        .store_quota
        .as_deref()
        .map(loip_plan::parse_bytes)
        .transpose()
        .context("--store-quota")?;
    opts.bandwidth = a
        .bandwidth
        .as_deref()
        .map(loip_plan::parse_bandwidth)
        .transpose()
        .context("--bandwidth")?;
    if a.exit_with_parent {
        exit_when_parent_dies();
    }
    let lan = Lan {
        name: announced_name(opts.name.as_deref()),
        key: id.public(),
        pairing: (own_token && (a.pair || !store.join(PAIRED).exists())).then_some(a.pair_window),
        // a worker on loopback cannot be reached from the LAN: not announced
        announce: !a.no_announce && !token::is_loopback(&a.listen),
        store,
    };
    serve(opts, lan)
}

/// How this worker shows itself on the LAN.
struct Lan {
    /// the name it announces
    name: String,
    /// its static public key
    key: [u8; 32],
    /// `Some(window)`: it takes a pairing code for this long
    pairing: Option<std::time::Duration>,
    /// announce it at all
    announce: bool,
    /// its store (where a paired token is kept)
    store: PathBuf,
}

/// The name a worker announces: `--name`, else the host's name (made `[A-Za-z0-9._-]`).
fn announced_name(name: Option<&str>) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let n: String = name
        .unwrap_or(host.trim())
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(discovery::MAX_NAME)
        .collect();
    let n = n.trim_start_matches('.').to_string();
    if n.is_empty() {
        "loip-worker".into()
    } else {
        n
    }
}

/// What the pairing thread tells the serving loop.
enum PairEvent {
    /// paired: serve with this token, for this coordinator alone, from now on
    Paired(pairing::Paired),
    /// no more codes taken (why)
    Closed(String),
}

/// Opens the pairing port beside `listen` and answers codes on a thread. Returns its port.
fn start_pairing(
    listen: &str,
    token: &str,
    lan: &Lan,
    tx: tokio::sync::mpsc::UnboundedSender<PairEvent>,
) -> Result<u16> {
    use std::net::ToSocketAddrs;
    let mut at = (listen.to_socket_addrs())
        .with_context(|| format!("--listen {listen}"))?
        .next()
        .with_context(|| format!("--listen {listen}: no address"))?;
    at.set_port(0);
    let l = std::net::TcpListener::bind(at).with_context(|| format!("the pairing port on {at}"))?;
    let port = l.local_addr()?.port();
    let code = pairing::code(token, &lan.key);
    println!("pairing code {}", pairing::display(&code));
    let _ = std::io::stdout().flush();
    eprintln!(
        "pair this worker: on the coordinator run `loip pair {} --device {}` (or, without \
         discovery, `--addr THIS-HOST:{port}`); the code is taken for {} s, {} tries",
        pairing::display(&code),
        lan.name,
        lan.pairing.unwrap_or_default().as_secs(),
        pairing::MAX_TRIES
    );
    let card = pairing::Card {
        name: lan.name.clone(),
        key: loip_runtime::wire::hex(&lan.key),
    };
    let (store, window) = (lan.store.clone(), lan.pairing.unwrap_or_default());
    std::thread::Builder::new()
        .name("loip-pairing".into())
        .spawn(move || {
            let keep = |p: &pairing::Paired| {
                let t = &p.token;
                pairing::write_private(&store.join(token::STORE_TOKEN), &format!("{t}\n"))
                    .and_then(|()| pairing::pin_coordinator(&store, &p.coordinator))
                    .and_then(|()| {
                        pairing::write_private(
                            &store.join(PAIRED),
                            "paired by a coordinator; `loip worker --pair` takes a code again\n",
                        )
                    })
                    .map_err(|e| format!("the worker could not keep the token: {e}"))
            };
            let ended = pairing::serve(l, &code, &card, window, keep, |l| eprintln!("{l}"));
            let _ = tx.send(match ended {
                Ok(pairing::Ended::Paired(t)) => PairEvent::Paired(t),
                Ok(pairing::Ended::TooManyTries) => PairEvent::Closed(format!(
                    "pairing closed after {} wrong codes (restart with --pair to take one again)",
                    pairing::MAX_TRIES
                )),
                Ok(pairing::Ended::WindowOver) => PairEvent::Closed(
                    "the pairing window ended (restart with --pair to take a code again)".into(),
                ),
                Err(e) => PairEvent::Closed(format!("pairing stopped: {e}")),
            });
        })?;
    Ok(port)
}

/// Binds and serves; re-binds with the coordinator's token when a pairing hands one over.
fn serve(mut opts: WorkerOptions, lan: Lan) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("loip-worker-io")
        .build()?;
    rt.block_on(async move {
        let mut announcer = None;
        if lan.announce {
            match discovery::Announcer::new() {
                Ok(a) => announcer = Some(a),
                Err(e) => eprintln!("warning: not announced on the LAN: {e}"),
            }
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut pair_port = None;
        let mut first = true;
        loop {
            let w = Worker::bind(opts.clone()).await?;
            let addr = w.local_addr();
            if first {
                // the first stdout line says where it listens; the pairing code comes after
                println!("listening on {addr}");
                let _ = std::io::stdout().flush();
                first = false;
                if let (Some(_), Some(t)) = (&lan.pairing, &opts.token) {
                    pair_port = Some(start_pairing(&opts.listen, t, &lan, tx.clone())?);
                }
            }
            let announce = |a: &mut discovery::Announcer, pair_port| {
                let ann = discovery::Announcement {
                    name: lan.name.clone(),
                    port: addr.port(),
                    mem: opts.mem_budget,
                    key: lan.key,
                    pair_port,
                };
                match a.announce(&ann) {
                    Ok(()) => eprintln!("announced as {} on the LAN ({})", ann.name, discovery::SERVICE),
                    Err(e) => eprintln!("warning: not announced on the LAN: {e}"),
                }
            };
            if let Some(a) = announcer.as_mut() {
                announce(a, pair_port);
            }
            let serving = w.serve();
            tokio::pin!(serving);
            loop {
                tokio::select! {
                    r = &mut serving => return r.map_err(anyhow::Error::from),
                    ev = rx.recv(), if pair_port.is_some() => match ev {
                        Some(PairEvent::Paired(p)) => {
                            eprintln!("paired: serving with the coordinator's token (kept in the store), for its key alone");
                            opts.token = Some(p.token);
                            opts.coordinator_key = Some(p.coordinator);
                            pair_port = None;
                            break;
                        }
                        Some(PairEvent::Closed(why)) => {
                            eprintln!("{why}");
                            pair_port = None;
                            if let Some(a) = announcer.as_mut() {
                                announce(a, None);
                            }
                        }
                        None => {
                            pair_port = None;
                            if let Some(a) = announcer.as_mut() {
                                announce(a, None);
                            }
                        }
                    },
                }
            }
        }
    })
}
