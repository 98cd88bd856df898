//! Cluster files: the shipped examples parse and plan; bad input gives an error naming the field.

mod common;

use loip_plan::planners::{plan_all, PlanRequest};
use loip_plan::{Cluster, ConfigError, Pattern};

fn no_files(path: &str) -> Result<String, String> {
    Err(format!("no file {path} in this test"))
}

fn parse(text: &str) -> Result<Cluster, ConfigError> {
    Cluster::from_toml_str(text, &mut no_files)
}

/// The error message, which must name `field`.
fn err_naming(text: &str, field: &str) -> String {
    let e = parse(text).expect_err("must fail");
    let msg = e.to_string();
    assert!(msg.contains(field), "error `{msg}` does not name `{field}`");
    msg
}

const LINK: &str = "[link]\nbandwidth = \"100mbit\"\nlatency = \"2ms\"\n";

#[test]
fn examples_parse_and_plan() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/clusters");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        seen += 1;
        let text = std::fs::read_to_string(&path).unwrap();
        let base = path.parent().unwrap().to_path_buf();
        let mut load = |p: &str| std::fs::read_to_string(base.join(p)).map_err(|e| e.to_string());
        let cluster = Cluster::from_toml_str(&text, &mut load)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let shape = if name.contains("13b") {
            common::llama13b()
        } else if name.contains("32b") {
            common::qwen32b()
        } else if name.contains("70b") {
            common::llama70b()
        } else {
            loip_plan::ModelShape::from_dims(
                "llama-1b", 2048, 5632, 22, 32, 4, 64, 32000, false, 2.0, 2,
            )
        };
        for pattern in [Pattern::Sporadic, Pattern::Bursty] {
            let req = PlanRequest {
                context: cluster.defaults.context.unwrap_or(2048),
                pattern,
                ..PlanRequest::default()
            };
            let results = plan_all(&shape, &cluster, &req);
            let loip = results.iter().find(|r| r.0 == "loip").unwrap();
            let p = loip
                .1
                .as_ref()
                .unwrap_or_else(|e| panic!("{name}: loip: {e}"));
            p.validate(&shape, &cluster).unwrap();
        }
    }
    assert!(seen >= 5, "{seen} example files");
}

#[test]
fn all_device_forms() {
    let text = format!(
        "{LINK}
[[device]]
name = \"a\"
preset = \"orin64\"
reserve = \"5GB\"
addr = \"127.0.0.1:7001\"

[[device]]
name = \"b\"
profile = \"p.json\"
mem = \"8GiB\"

[[device]]
name = \"c\"
mem = \"8GiB\"
mem_bw = \"40GB/s\"
peak_flops = 1e12
ssd = \"2GB/s\"
ssd_overhead = \"50us\"

[plan]
planner = \"loip-paper\"
context = 4096
pattern = \"bursty\"
"
    );
    let profile = loip_plan::profile::preset("nx16").unwrap().to_json();
    let mut load = |p: &str| {
        if p == "p.json" {
            Ok(profile.clone())
        } else {
            Err("missing".to_string())
        }
    };
    let c = Cluster::from_toml_str(&text, &mut load).unwrap();
    assert_eq!(c.devices.len(), 3);
    assert_eq!(c.devices[0].reserve, 5_000_000_000);
    assert_eq!(c.devices[0].addr.as_deref(), Some("127.0.0.1:7001"));
    assert_eq!(c.devices[1].profile.mem_budget, 8 << 30);
    assert_eq!(c.devices[1].profile.name, "jetson-xavier-nx-16gb");
    assert_eq!(c.devices[2].profile.loader.direct.bandwidth, 2e9);
    assert_eq!(c.devices[2].profile.loader.direct.per_read_overhead, 50e-6);
    assert_eq!(c.link.bandwidth, 12.5e6);
    assert_eq!(c.link.latency, 2e-3);
    assert_eq!(c.defaults.planner.as_deref(), Some("loip-paper"));
    assert_eq!(c.defaults.context, Some(4096));
    assert_eq!(c.defaults.pattern, Some(Pattern::Bursty));
}

#[test]
fn missing_fields_are_named() {
    err_naming(LINK, "device");
    err_naming(
        &format!("{LINK}[[device]]\npreset = \"orin64\"\n"),
        "device[0].name",
    );
    err_naming(
        &format!(
            "{LINK}[[device]]\nname = \"a\"\npreset = \"orin64\"\n[[device]]\npreset = \"nx16\"\n"
        ),
        "device[1].name",
    );
    err_naming("[[device]]\nname = \"a\"\npreset = \"orin64\"\n", "link");
    err_naming(
        "[link]\nlatency = \"2ms\"\n[[device]]\nname = \"a\"\npreset = \"orin64\"\n",
        "link.bandwidth",
    );
    err_naming(
        "[link]\nbandwidth = \"1gbit\"\n[[device]]\nname = \"a\"\npreset = \"orin64\"\n",
        "link.latency",
    );
    // Inline device without its required values.
    err_naming(
        &format!("{LINK}[[device]]\nname = \"a\"\nmem = \"8GiB\"\n"),
        "device[0].mem_bw",
    );
    err_naming(
        &format!("{LINK}[[device]]\nname = \"a\"\nmem_bw = \"40GB/s\"\n"),
        "device[0].mem",
    );
    err_naming(&format!("{LINK}[[device]]\nname = \"a\"\nmem = \"8GiB\"\nmem_bw = \"40GB/s\"\npeak_flops = 1e12\n"), "device[0].ssd");
}

#[test]
fn zero_or_negative_bandwidth_is_rejected() {
    let dev = "[[device]]\nname = \"a\"\npreset = \"orin64\"\n";
    for bw in ["\"0mbit\"", "\"-100mbit\"", "0", "-5", "0.0"] {
        let msg = err_naming(
            &format!("[link]\nbandwidth = {bw}\nlatency = \"2ms\"\n{dev}"),
            "link.bandwidth",
        );
        assert!(
            msg.contains("positive") || msg.contains("negative"),
            "{msg}"
        );
    }
    err_naming(
        &format!("[link]\nbandwidth = \"100 furlongs\"\nlatency = \"2ms\"\n{dev}"),
        "link.bandwidth",
    );
    err_naming(
        &format!("[link]\nbandwidth = \"100mbit\"\nlatency = \"-2ms\"\n{dev}"),
        "link.latency",
    );
    let inline =
        "[[device]]\nname = \"a\"\nmem = \"8GiB\"\nmem_bw = \"40GB/s\"\npeak_flops = 1e12\n";
    err_naming(&format!("{LINK}{inline}ssd = \"0MB/s\"\n"), "device[0].ssd");
    err_naming(
        &format!("{LINK}{inline}ssd = \"-2GB/s\"\n"),
        "device[0].ssd",
    );
    err_naming(&format!("{LINK}[[device]]\nname = \"a\"\nmem = \"8GiB\"\nmem_bw = 0\npeak_flops = 1e12\nssd = \"1GB/s\"\n"), "device[0].mem_bw");
}

#[test]
fn unknown_names_are_rejected() {
    let msg = err_naming(
        &format!("{LINK}[[device]]\nname = \"a\"\npreset = \"orin128\"\n"),
        "device[0].preset",
    );
    assert!(msg.contains("orin64") && msg.contains("nx16"), "{msg}");
    let msg = err_naming(
        &format!(
            "{LINK}[[device]]\nname = \"a\"\npreset = \"orin64\"\n[plan]\nplanner = \"magic\"\n"
        ),
        "plan.planner",
    );
    assert!(msg.contains("loip") && msg.contains("edgeshard"), "{msg}");
    err_naming(&format!("{LINK}[[device]]\nname = \"a\"\npreset = \"orin64\"\n[plan]\npattern = \"sometimes\"\n"), "plan.pattern");
    // A misspelt key is an error, not silently ignored.
    err_naming(
        &format!("{LINK}[[device]]\nname = \"a\"\npreset = \"orin64\"\nreserv = \"1GB\"\n"),
        "reserv",
    );
}

#[test]
fn other_bad_values() {
    err_naming(&format!("{LINK}[[device]]\nname = \"a\"\npreset = \"orin64\"\n[[device]]\nname = \"a\"\npreset = \"nx16\"\n"), "device[1].name");
    err_naming(
        &format!("{LINK}[[device]]\nname = \"a\"\npreset = \"nx16\"\nreserve = \"20GB\"\n"),
        "device[0].reserve",
    );
    err_naming(
        &format!("{LINK}[[device]]\nname = \"a\"\npreset = \"nx16\"\nreserve = \"-1GB\"\n"),
        "device[0].reserve",
    );
    err_naming(
        &format!("{LINK}[[device]]\nname = \"a\"\npreset = \"nx16\"\nprofile = \"x.json\"\n"),
        "device[0].profile",
    );
    err_naming(
        &format!("{LINK}[[device]]\nname = \"a\"\nprofile = \"x.json\"\n"),
        "device[0].profile",
    );
    err_naming(
        &format!("{LINK}[[device]]\nname = \"a\"\npreset = \"nx16\"\nmem_bw = \"1GB/s\"\n"),
        "device[0].mem_bw",
    );
    err_naming(&format!("{LINK}[[device]]\nname = \"a\"\nmem = \"8GiB\"\nmem_bw = \"4GB/s\"\npeak_flops = 1e12\nssd = \"1GB/s\"\nefficiency = 1.5\n"), "device[0].efficiency");
    err_naming(
        &format!("{LINK}[[device]]\nname = \"a\"\npreset = \"nx16\"\n[plan]\ncontext = -1\n"),
        "plan.context",
    );
    err_naming(
        &format!("{LINK}[[device]]\nname = \"a\"\npreset = \"nx16\"\n[plan]\nmicro_batches = 0\n"),
        "plan.micro_batches",
    );
    let bad_profile = "{\"name\": \"x\", \"mem_budget\": 1000}";
    let text = format!("{LINK}[[device]]\nname = \"a\"\nprofile = \"p.json\"\n");
    let e = Cluster::from_toml_str(&text, &mut |_| Ok(bad_profile.to_string())).unwrap_err();
    assert!(e.to_string().contains("device[0].profile"), "{e}");
}
