//! The body of the `api_request` fuzz target (`fuzz/bodies/api_request.rs`) run on stable over
//! a stated number of seeded inputs, random and mutated from the target's seeds, so CI
//! exercises it without `cargo fuzz`. A panic fails the test; the run prints its input count.

#[path = "../../../fuzz/bodies/api_request.rs"]
mod api_request;
#[path = "../../../fuzz/bodies/mutate.rs"]
mod mutate;

#[test]
fn fuzz_body_api_request_100k() {
    let seeds = vec![
        include_bytes!("../../../fuzz/seeds/api_request/chat").to_vec(),
        include_bytes!("../../../fuzz/seeds/api_request/completion_ids").to_vec(),
    ];
    let mut rng = mutate::rng(37);
    let count = 100_000;
    let t = std::time::Instant::now();
    for _ in 0..count {
        api_request::run(&mutate::input(&mut rng, &seeds, 4096));
    }
    eprintln!(
        "fuzz body api_request: {count} inputs in {:.1} s, no panic",
        t.elapsed().as_secs_f64()
    );
}
