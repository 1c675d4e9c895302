//! `consumers_line`: see `tollgate_config::fuzz::consumers_line`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate_config::fuzz::consumers_line(data));
