//! `h2_frames`: see `tollgate_gateway::fuzz::h2_frames`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate_gateway::fuzz::h2_frames(data));
