//! Body of the `api_request` target: what a client sends `loip api`, a completion or chat
//! request body, parsed and checked as the endpoints do before any model work
//! (`loip_server::check_request`). The first byte picks the endpoint (odd: chat); every body
//! must end in `Ok` or a 4xx message, never a panic.

/// Runs one input.
pub fn run(data: &[u8]) {
    let Some((&pick, body)) = data.split_first() else {
        return;
    };
    let _ = loip_server::check_request(body, pick & 1 == 1, 49_152);
}
