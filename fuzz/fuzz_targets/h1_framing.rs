//! `h1_framing`: see `tollgate_gateway::fuzz::h1_framing`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate_gateway::fuzz::h1_framing(data));
