//! Durations (`250ms`, `10s`, `5m`, `2h`, `30d`) and byte sizes (`16KiB`, `10MiB`, `8192`)
//! as written in the config file.

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;
use std::fmt;
use std::time::Duration;

/// A duration written as an integer and a unit: `ms`, `s`, `m`, `h` or `d`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Dur(pub Duration);

/// Parses `250ms`, `10s`, `5m`, `2h`, `30d`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("duration {s:?} has no unit; write e.g. 10s, 5m, 2h, 30d, 250ms"))?;
    let (num, unit) = s.split_at(split);
    if let Some(frac) = unit.strip_prefix(['.', ',']) {
        let digits = frac
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(frac.len());
        let hint = match (
            format!("{num}.{}", &frac[..digits]).parse::<f64>(),
            &frac[digits..],
        ) {
            (Ok(v), "s") => format!("; write {}ms", (v * 1000.0).round()),
            (Ok(v), "m") => format!("; write {}s", (v * 60.0).round()),
            (Ok(v), "h") => format!("; write {}m", (v * 60.0).round()),
            (Ok(v), "d") => format!("; write {}h", (v * 24.0).round()),
            _ => String::new(),
        };
        return Err(format!(
            "duration {s:?} must be a whole number with a unit{hint}"
        ));
    }
    let n: u64 = num
        .parse()
        .map_err(|_| format!("duration {s:?} must start with a whole number"))?;
    let ms = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => {
            return Err(format!(
                "duration {s:?} has unknown unit {unit:?}; use ms, s, m, h or d"
            ))
        }
    };
    n.checked_mul(ms)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("duration {s:?} is too large"))
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Dur;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a duration such as 250ms, 10s, 5m, 2h or 30d")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Dur, E> {
                parse_duration(v).map(Dur).map_err(E::custom)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Dur, E> {
                Err(E::custom(format!(
                    "duration {v} has no unit; write e.g. {v}s or {v}ms"
                )))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Dur, E> {
                self.visit_u64(v.unsigned_abs())
            }
        }
        d.deserialize_any(V)
    }
}

/// Text that YAML may read as a number when unquoted (`min_version: 1.2`): kept as the
/// text it was written as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Text(pub String);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Text;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("text")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

/// A size in bytes, written as an integer or with a unit: `KiB`, `MiB`, `GiB` (powers of
/// 1024) or `KB`, `MB`, `GB` (powers of 1000).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size(pub u64);

/// Parses `8192`, `16KiB`, `10MiB`, `1GiB`, `64KB`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("size {s:?} must start with a whole number"))?;
    let mult = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        u => {
            return Err(format!(
                "size {s:?} has unknown unit {u:?}; use KiB, MiB, GiB (or KB, MB, GB)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Size;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a size such as 8192, 16KiB or 10MiB")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Size, E> {
                parse_size(v).map(Size).map_err(E::custom)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Size, E> {
                Ok(Size(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Size, E> {
                u64::try_from(v)
                    .map(Size)
                    .map_err(|_| E::custom("a size cannot be negative"))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("100s"), Ok(Duration::from_secs(100)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("30d"), Ok(Duration::from_secs(30 * 86400)));
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("10 parsecs").is_err());
        assert!(parse_duration("s").is_err());
        assert_eq!(
            parse_duration("1.5s"),
            Err("duration \"1.5s\" must be a whole number with a unit; write 1500ms".into())
        );
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("8192"), Ok(8192));
        assert_eq!(parse_size("16KiB"), Ok(16384));
        assert_eq!(parse_size("10MiB"), Ok(10 << 20));
        assert!(parse_size("10XB").is_err());
    }
}
