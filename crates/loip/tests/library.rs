//! The library's entry point as a program uses it: SmolLM2 by name, in memory and from
//! slice files under a budget that forces offloading, gives the same greedy text.

use loip::{Loip, OffloadOptions, Placement};
use loip_runtime::local::OffloadRule;

#[test]
fn smollm2_by_name_in_memory_and_offloaded_gives_the_same_text() {
    let prompt = "The three primary colours are";
    let memory = Loip::open("smollm2", Placement::Memory).unwrap();
    let mut pieces = String::new();
    let text = memory
        .generate(prompt, 12, &mut |p| pieces.push_str(p))
        .unwrap();
    memory.shutdown();
    assert!(!text.is_empty());
    assert_eq!(pieces, text, "the streamed pieces make up the text");

    // every block streamed from slice files
    let offload = OffloadOptions {
        rule: OffloadRule::All,
        ..Default::default()
    };
    let sliced = Loip::open("smollm2", Placement::Offload(offload)).unwrap();
    let again = sliced.generate(prompt, 12, &mut |_| {}).unwrap();
    sliced.shutdown();
    assert_eq!(again, text);
}
