use loip_sim::experiments::*;
use loip_sim::*;
use loip_plan::Pattern;
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let setup_name = &a[1]; let method = Method::from_name(&a[2]).unwrap();
    let pattern: Pattern = a[3].parse().unwrap(); let bw: f64 = a[4].parse().unwrap();
    let exps = experiments("all").unwrap();
    let setup = exps.iter().flat_map(|e| e.setups.iter()).find(|s| &s.name == setup_name).unwrap();
    let shape = shape(&setup.shape).unwrap();
    let cluster = setup.cluster().unwrap();
    let bwv = if bw == 0.0 { Bandwidth::PAPER_DYNAMIC } else { Bandwidth::Mbps(bw) };
    let mut cfg = run_config(&ExperimentConfig::default(), setup, pattern, bwv);
    if let Some(o) = a.get(5) { cfg.output_tokens = o.parse().unwrap(); }
    cfg.record_memory = true;
    let r = run_method(method, &shape, &cluster, &cfg).unwrap();
    if let Some(p) = &r.plan {
        println!("plan s={} b={} pred={:.1} breakdown={:?}", p.stages_per_device, p.micro_batches, p.predicted_ms_per_token, p.breakdown);
        for d in &p.devices { let (n,a_,m) = d.stages[0].counts(); println!("  {} n={} a={} m={} mem={:.2}GB budget={:.2}GB compute_ms={:.1} load_ms={:.1} stall={:.1}", d.name, n, a_, m, d.memory_bytes as f64/1e9, d.budget_bytes as f64/1e9, d.compute_ms, d.load_ms, d.stall_ms); }
    }
    let rep = &r.report;
    println!("status {} ms/token {:.1} steady {:.1} steps {} note {:?}", rep.status, rep.ms_per_token, rep.steady_ms_per_token, rep.steps, rep.note);
    for d in &rep.devices { println!("  {} compute {:.2}s load {:.2}s sent {:.1}MB peak {:.2}GB TS1 {:?}", d.name, d.compute_s, d.load_s, d.bytes_sent/1e6, d.peak_memory as f64/1e9, d.first_threshold); }
    for e in rep.events.iter().take(30) { println!("  {:?}", e); }
    let st = &rep.step_end_s; let n = st.len();
    println!("first steps {:?}", &st[..n.min(5)]);
    if n > 2 { println!("last step dur {:.4}", st[n-1]-st[n-2]); }
}
