//! Cluster files: which devices take part, their profiles, and the link between them.
//!
//! Three steps (STYLE §8): [`RawCluster`] is what serde reads from TOML;
//! [`RawCluster::validate`] checks every field and returns a [`ConfigError`] naming the bad
//! one; the result is a resolved [`Cluster`] whose devices carry complete profiles. Device
//! order in the file is pipeline order (device 1 holds the embedding).
//!
//! ```toml
//! [link]
//! bandwidth = "100mbit"        # or "1gbit", "50MB/s", or a number of bytes/s
//! latency = "2ms"
//!
//! [[device]]
//! name = "orin64-a"
//! preset = "orin64"            # or profile = "profiles/x.json", or inline values below
//! reserve = "5GB"              # memory kept free for other programs (default 0)
//! addr = "127.0.0.1:7001"      # used by the runtime
//!
//! [[device]]
//! name = "laptop"
//! mem = "8GiB"                 # inline: mem, mem_bw, peak_flops, ssd required;
//! mem_bw = "40GB/s"            #   efficiency (0.6), block_overhead ("30us"),
//! peak_flops = 1e12            #   ssd_overhead ("0.1ms"), ssd_conventional (ssd/2),
//! ssd = "2GB/s"                #   ssd_conventional_overhead ("1ms") optional.
//!                              # `mem` with a preset/profile overrides its budget.
//! [plan]                       # optional defaults, overridden by CLI flags
//! planner = "loip"
//! context = 4096
//! pattern = "bursty"
//! ```
//!
//! File access stays outside: the caller passes a closure that returns a profile file's text.

use crate::error::ConfigError;
use crate::plan::{Pattern, PLANNER_NAMES};
use crate::profile::{
    preset, preset_names, ComputeModel, DeviceProfile, LinkProfile, LoaderKind, LoaderProfile,
    Loaders, Roofline,
};
use crate::units::{parse_bandwidth, parse_bytes, parse_duration};
use serde::{Deserialize, Serialize};

/// A number or a unit-bearing string in a cluster file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum NumOrStr {
    /// A bare number (bytes, bytes/s, seconds or FLOP/s, depending on the field).
    Num(f64),
    /// A string with a unit.
    Str(String),
}

/// One `[[device]]` entry as written.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct RawDevice {
    pub name: Option<String>,
    pub profile: Option<String>,
    pub preset: Option<String>,
    pub mem: Option<NumOrStr>,
    pub reserve: Option<NumOrStr>,
    pub addr: Option<String>,
    pub mem_bw: Option<NumOrStr>,
    pub peak_flops: Option<f64>,
    pub efficiency: Option<f64>,
    pub block_overhead: Option<NumOrStr>,
    pub ssd: Option<NumOrStr>,
    pub ssd_overhead: Option<NumOrStr>,
    pub ssd_conventional: Option<NumOrStr>,
    pub ssd_conventional_overhead: Option<NumOrStr>,
    /// Devices naming the same disk read from it together (several workers on one host).
    pub disk: Option<String>,
}

/// The `[link]` table as written.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct RawLink {
    pub bandwidth: Option<NumOrStr>,
    pub latency: Option<NumOrStr>,
}

/// The optional `[plan]` table as written.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct RawPlanDefaults {
    pub planner: Option<String>,
    pub context: Option<i64>,
    pub pattern: Option<String>,
    pub micro_batches: Option<i64>,
    pub loader: Option<String>,
}

/// A cluster file as written.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCluster {
    /// `[[device]]` entries, in pipeline order.
    #[serde(default)]
    pub device: Vec<RawDevice>,
    /// `[link]`.
    pub link: Option<RawLink>,
    /// `[plan]`.
    pub plan: Option<RawPlanDefaults>,
}

/// A resolved device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Device {
    /// Unique name within the cluster; plans refer to devices by it.
    pub name: String,
    /// Complete profile.
    pub profile: DeviceProfile,
    /// Memory kept free for other programs, subtracted from the profile's budget.  // bytes
    pub reserve: u64,
    /// Network address of its worker, if given.
    pub addr: Option<String>,
}

impl Device {
    /// Memory the plan may use on this device: profile budget minus reservation.  // bytes
    pub fn budget(&self) -> u64 {
        self.profile.mem_budget.saturating_sub(self.reserve)
    }
}

/// Defaults from the `[plan]` table.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanDefaults {
    /// Planner name (checked against the registry).
    pub planner: Option<String>,
    /// Planned context (tokens).
    pub context: Option<u64>,
    /// Request pattern.
    pub pattern: Option<Pattern>,
    /// Sequences in flight.
    pub micro_batches: Option<u32>,
    /// Loader.
    pub loader: Option<LoaderKind>,
}

/// A validated cluster.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    /// Devices in pipeline order; names are unique.
    pub devices: Vec<Device>,
    /// The link between any two devices.
    pub link: LinkProfile,
    /// `[plan]` defaults.
    #[serde(default)]
    pub defaults: PlanDefaults,
    /// Groups of devices that read their offloaded blocks from one disk (several workers on
    /// one host, e.g. `loip local`): their loads in one round share the disk's rate
    /// ([`Cluster::disk_mates`]). Devices in no group have a disk of their own.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<Vec<String>>,
    /// Per group of `disks`: the disk's rate with all its devices reading at once, in all
    /// (measured by the runtime with every loader probed together); 0 or absent: unknown,
    /// each running load gets `1/n` of its own rate alone ([`crate::cost`]).  // bytes/s
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disk_rates: Vec<f64>,
    /// The coordinator's own part of a step, once per micro-batch's trip: from the last hop's
    /// arrival to the next step's dispatch (its wake-up, sampling, the submission). Measured
    /// by the runtime on the coordinator's machine; 0 when the coordinator is not modelled
    /// (the paper's presets). The cost model adds it to the last round ([`crate::cost`]).
    /// // seconds
    #[serde(default, skip_serializing_if = "is_zero")]
    pub coordinator: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

impl Cluster {
    /// A cluster of shipped presets ([`crate::profile::preset`]), devices named
    /// `PRESET-INDEX`, no reservations; `None` if a name is not a preset.
    pub fn of_presets(presets: &[&str], link: LinkProfile) -> Option<Cluster> {
        let devices = presets
            .iter()
            .enumerate()
            .map(|(i, p)| Some((format!("{p}-{i}"), crate::profile::preset(p)?)))
            .collect::<Option<Vec<_>>>()?;
        Some(Cluster::new(devices, link))
    }

    /// A cluster from devices given as (name, profile), no reservations.
    pub fn new(devices: Vec<(String, DeviceProfile)>, link: LinkProfile) -> Cluster {
        Cluster {
            devices: devices
                .into_iter()
                .map(|(name, profile)| Device {
                    name,
                    profile,
                    reserve: 0,
                    addr: None,
                })
                .collect(),
            link,
            defaults: PlanDefaults::default(),
            disks: Vec::new(),
            disk_rates: Vec::new(),
            coordinator: 0.0,
        }
    }

    /// The devices that share `name`'s disk, `name` included (just `name` when it has a disk
    /// of its own).
    pub fn disk_mates<'a>(&'a self, name: &'a str) -> Vec<&'a str> {
        match self.disks.iter().find(|g| g.iter().any(|n| n == name)) {
            Some(g) => g.iter().map(String::as_str).collect(),
            None => vec![name],
        }
    }

    /// Parses and validates a TOML cluster file. `load_profile(path)` returns the text of a
    /// profile JSON file named by a `profile = "..."` field (the caller resolves the path).
    pub fn from_toml_str(
        text: &str,
        load_profile: &mut dyn FnMut(&str) -> Result<String, String>,
    ) -> Result<Cluster, ConfigError> {
        let raw: RawCluster = toml::from_str(text).map_err(|e| ConfigError::Syntax {
            what: "cluster file".into(),
            reason: e.to_string(),
        })?;
        raw.validate(load_profile)
    }

    /// Index of the device called `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.devices.iter().position(|d| d.name == name)
    }

    /// The device called `name`.
    pub fn device(&self, name: &str) -> Option<&Device> {
        self.devices.iter().find(|d| d.name == name)
    }
}

fn invalid(field: &str, reason: impl std::fmt::Display) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_string(),
        reason: reason.to_string(),
    }
}

fn bytes_field(field: &str, v: &NumOrStr) -> Result<u64, ConfigError> {
    match v {
        NumOrStr::Num(n) if *n >= 0.0 && n.is_finite() => Ok(*n as u64),
        NumOrStr::Num(n) => Err(invalid(field, format!("{n} is negative"))),
        NumOrStr::Str(s) => parse_bytes(s).map_err(|e| invalid(field, e)),
    }
}

fn bandwidth_field(field: &str, v: &NumOrStr) -> Result<f64, ConfigError> {
    match v {
        NumOrStr::Num(n) if *n > 0.0 && n.is_finite() => Ok(*n),
        NumOrStr::Num(n) => Err(invalid(field, format!("{n} must be positive"))),
        NumOrStr::Str(s) => parse_bandwidth(s).map_err(|e| invalid(field, e)),
    }
}

fn duration_field(field: &str, v: &NumOrStr) -> Result<f64, ConfigError> {
    match v {
        NumOrStr::Num(n) if *n >= 0.0 && n.is_finite() => Ok(*n),
        NumOrStr::Num(n) => Err(invalid(field, format!("{n} is negative"))),
        NumOrStr::Str(s) => parse_duration(s).map_err(|e| invalid(field, e)),
    }
}

fn require<T>(field: String, v: &Option<T>) -> Result<&T, ConfigError> {
    v.as_ref().ok_or(ConfigError::Missing { field })
}

impl RawDevice {
    fn resolve(
        &self,
        i: usize,
        load_profile: &mut dyn FnMut(&str) -> Result<String, String>,
    ) -> Result<Device, ConfigError> {
        let f = |name: &str| format!("device[{i}].{name}");
        let name = require(f("name"), &self.name)?.trim().to_string();
        if name.is_empty() {
            return Err(invalid(&f("name"), "must not be empty"));
        }
        let sources = [self.profile.is_some(), self.preset.is_some()]
            .iter()
            .filter(|&&b| b)
            .count();
        if sources > 1 {
            return Err(invalid(
                &f("profile"),
                "give either `profile` or `preset`, not both",
            ));
        }
        let mut profile = if let Some(path) = &self.profile {
            let text = load_profile(path)
                .map_err(|e| invalid(&f("profile"), format!("cannot read `{path}`: {e}")))?;
            DeviceProfile::from_json(&text)
                .map_err(|e| invalid(&f("profile"), format!("`{path}`: {e}")))?
        } else if let Some(p) = &self.preset {
            preset(p).ok_or_else(|| ConfigError::UnknownPreset {
                field: f("preset"),
                name: p.clone(),
                valid: preset_names().join(", "),
            })?
        } else {
            let mem = bytes_field(&f("mem"), require(f("mem"), &self.mem)?)?;
            let mem_bw = bandwidth_field(&f("mem_bw"), require(f("mem_bw"), &self.mem_bw)?)?;
            let peak_flops = *require(f("peak_flops"), &self.peak_flops)?;
            if !(peak_flops > 0.0 && peak_flops.is_finite()) {
                return Err(invalid(&f("peak_flops"), "must be positive"));
            }
            let efficiency = self.efficiency.unwrap_or(0.6);
            if !(efficiency > 0.0 && efficiency <= 1.0) {
                return Err(invalid(&f("efficiency"), "must be in (0, 1]"));
            }
            let block_overhead = match &self.block_overhead {
                Some(v) => duration_field(&f("block_overhead"), v)?,
                None => 30e-6,
            };
            let ssd = bandwidth_field(&f("ssd"), require(f("ssd"), &self.ssd)?)?;
            let ssd_overhead = match &self.ssd_overhead {
                Some(v) => duration_field(&f("ssd_overhead"), v)?,
                None => 1e-4,
            };
            let conv_bw = match &self.ssd_conventional {
                Some(v) => bandwidth_field(&f("ssd_conventional"), v)?,
                None => ssd / 2.0,
            };
            let conv_overhead = match &self.ssd_conventional_overhead {
                Some(v) => duration_field(&f("ssd_conventional_overhead"), v)?,
                None => 1e-3,
            };
            DeviceProfile {
                name: name.clone(),
                mem_budget: mem,
                compute: ComputeModel::Roofline(Roofline {
                    mem_bw,
                    peak_flops,
                    efficiency,
                    block_overhead,
                    prefill_flops: None,
                }),
                loader: Loaders {
                    direct: LoaderProfile {
                        bandwidth: ssd,
                        per_read_overhead: ssd_overhead,
                    },
                    conventional: LoaderProfile {
                        bandwidth: conv_bw,
                        per_read_overhead: conv_overhead,
                    },
                },
                sources: vec!["inline values in the cluster file".into()],
                memory: None,
                collective_latency: 0.0,
                load_slowdown: 0.0,
                hop_wake: 0.0,
                hop_extra: 0.0,
                switch_s: 0.0,
            }
        };
        if self.profile.is_some() || self.preset.is_some() {
            let inline_only = [
                ("mem_bw", self.mem_bw.is_some()),
                ("peak_flops", self.peak_flops.is_some()),
                ("efficiency", self.efficiency.is_some()),
                ("ssd", self.ssd.is_some()),
            ];
            if let Some((k, _)) = inline_only.iter().find(|(_, set)| *set) {
                return Err(invalid(
                    &f(k),
                    "only allowed for inline devices (without `profile`/`preset`)",
                ));
            }
            if let Some(m) = &self.mem {
                profile.mem_budget = bytes_field(&f("mem"), m)?;
            }
        }
        if profile.mem_budget == 0 {
            return Err(invalid(&f("mem"), "memory budget must be positive"));
        }
        let reserve = match &self.reserve {
            Some(v) => bytes_field(&f("reserve"), v)?,
            None => 0,
        };
        if reserve >= profile.mem_budget {
            return Err(invalid(&f("reserve"), "reservation leaves no memory"));
        }
        Ok(Device {
            name,
            profile,
            reserve,
            addr: self.addr.clone(),
        })
    }
}

impl RawCluster {
    /// Validates every field and resolves presets and profile files.
    pub fn validate(
        &self,
        load_profile: &mut dyn FnMut(&str) -> Result<String, String>,
    ) -> Result<Cluster, ConfigError> {
        if self.device.is_empty() {
            return Err(ConfigError::Missing {
                field: "device".into(),
            });
        }
        let mut devices = Vec::with_capacity(self.device.len());
        for (i, d) in self.device.iter().enumerate() {
            let dev = d.resolve(i, load_profile)?;
            if devices.iter().any(|x: &Device| x.name == dev.name) {
                return Err(invalid(
                    &format!("device[{i}].name"),
                    format!("`{}` is used twice", dev.name),
                ));
            }
            devices.push(dev);
        }
        let link = require("link".into(), &self.link)?;
        let bandwidth = bandwidth_field(
            "link.bandwidth",
            require("link.bandwidth".into(), &link.bandwidth)?,
        )?;
        let latency = duration_field(
            "link.latency",
            require("link.latency".into(), &link.latency)?,
        )?;
        let mut defaults = PlanDefaults::default();
        if let Some(p) = &self.plan {
            if let Some(name) = &p.planner {
                let valid = PLANNER_NAMES;
                if !valid.contains(&name.as_str()) {
                    return Err(ConfigError::UnknownPlanner {
                        field: "plan.planner".into(),
                        name: name.clone(),
                        valid: valid.join(", "),
                    });
                }
                defaults.planner = Some(name.clone());
            }
            if let Some(c) = p.context {
                if c < 0 {
                    return Err(invalid("plan.context", "must be >= 0"));
                }
                defaults.context = Some(c as u64);
            }
            if let Some(pat) = &p.pattern {
                defaults.pattern = Some(pat.parse().map_err(|e| invalid("plan.pattern", e))?);
            }
            if let Some(b) = p.micro_batches {
                if b < 1 || b > u32::MAX as i64 {
                    return Err(invalid("plan.micro_batches", "must be at least 1"));
                }
                defaults.micro_batches = Some(b as u32);
            }
            if let Some(l) = &p.loader {
                defaults.loader = Some(match l.as_str() {
                    "direct" => LoaderKind::Direct,
                    "conventional" => LoaderKind::Conventional,
                    _ => return Err(invalid("plan.loader", "must be `direct` or `conventional`")),
                });
            }
        }
        // devices naming one disk, in device order, groups in order of first mention
        let mut disks: Vec<(String, Vec<String>)> = Vec::new();
        for (d, raw) in devices.iter().zip(&self.device) {
            let Some(disk) = raw.disk.as_deref().map(str::trim) else {
                continue;
            };
            if disk.is_empty() {
                return Err(invalid(
                    &format!("device `{}`.disk", d.name),
                    "must not be empty",
                ));
            }
            match disks.iter_mut().find(|(k, _)| k == disk) {
                Some((_, g)) => g.push(d.name.clone()),
                None => disks.push((disk.to_string(), vec![d.name.clone()])),
            }
        }
        Ok(Cluster {
            devices,
            link: LinkProfile { bandwidth, latency },
            defaults,
            disks: disks
                .into_iter()
                .map(|(_, g)| g)
                .filter(|g| g.len() > 1)
                .collect(),
            disk_rates: Vec::new(),
            coordinator: 0.0,
        })
    }
}
