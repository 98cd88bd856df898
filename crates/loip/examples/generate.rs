//! Generates text with SmolLM2 (fetched, verified and cached on first use) in memory:
//! `cargo run --release -p loip --example generate -- "Once upon a time"`.

use loip::{Loip, Placement};

fn main() -> anyhow::Result<()> {
    let prompt = std::env::args()
        .nth(1)
        .unwrap_or("The three primary colours are".into());
    let model = Loip::open("smollm2", Placement::Memory)?;
    model.generate(&prompt, 32, &mut |piece| print!("{piece}"))?;
    println!();
    model.shutdown();
    Ok(())
}
