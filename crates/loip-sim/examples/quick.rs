use loip_sim::experiments::*;
fn main() {
    let name = std::env::args().nth(1).unwrap_or("end-to-end".into());
    let t0 = std::time::Instant::now();
    let r = run_experiments(experiments(&name).unwrap(), &ExperimentConfig::default(), &|_, _| {}).unwrap();
    for rec in &r.records {
        println!("{:20} {:14} {:22} {:9} {:>8} {:4} {:>10} pred {:>10} st {:?} sw {} lend {} ev {} {}",
            rec.experiment, rec.setup, rec.method, rec.pattern.to_string(), rec.bandwidth_mbps.map(|b| b.to_string()).unwrap_or("dyn".into()),
            rec.status.to_string(), rec.ms_per_token.map(|m| format!("{m:.1}")).unwrap_or("-".into()),
            rec.predicted_ms_per_token.map(|m| format!("{m:.1}")).unwrap_or("-".into()), rec.stages, rec.switches, rec.lends, rec.evicted_tokens,
            rec.note.clone().unwrap_or_default());
    }
    eprintln!("elapsed {:?}", t0.elapsed());
}
