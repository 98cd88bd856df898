//! Unit-bearing strings used by cluster files and CLI flags: byte sizes ("300MiB", "8GB"),
//! bandwidths ("100mbit", "1gbit", "50MB/s") and durations ("2ms", "150us").
//!
//! Decimal prefixes (k, M, G, T) are powers of 1000, binary ones (Ki, Mi, Gi, Ti) powers of
//! 1024. In a bandwidth a capital `B` is a byte and a lower-case `b`, `bit` or `bps` a bit.

use thiserror::Error;

/// A unit-bearing string ("300MiB", "100mbit", "2ms") could not be parsed.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum ParseError {
    /// The string is empty.
    #[error("empty value")]
    Empty,
    /// The numeric part is missing or malformed.
    #[error("`{0}` does not start with a number")]
    BadNumber(String),
    /// The unit is not one of the accepted ones.
    #[error("`{input}` has unknown unit `{unit}` (accepted: {accepted})")]
    BadUnit {
        /// The whole input.
        input: String,
        /// The unit part.
        unit: String,
        /// The accepted units, for the message.
        accepted: &'static str,
    },
    /// The value is negative, zero where zero is meaningless, or not finite.
    #[error("`{0}` must be positive")]
    NotPositive(String),
    /// The value does not fit in the target type.
    #[error("`{0}` is too large")]
    TooLarge(String),
}

/// Splits "12.5GiB" into (12.5, "GiB"). Rejects negative and non-finite numbers.
fn split_number(input: &str) -> Result<(f64, &str), ParseError> {
    let s = input.trim();
    if s.is_empty() {
        return Err(ParseError::Empty);
    }
    let end = s
        .char_indices()
        .find(|&(_, c)| !(c.is_ascii_digit() || c == '.' || c == '-' || c == '+' || c == '_'))
        .map(|(i, _)| i)
        .unwrap_or(s.len());
    let num: String = s[..end].chars().filter(|&c| c != '_').collect();
    let value: f64 = num
        .parse()
        .map_err(|_| ParseError::BadNumber(input.to_string()))?;
    if !value.is_finite() || value < 0.0 {
        return Err(ParseError::NotPositive(input.to_string()));
    }
    Ok((value, s[end..].trim()))
}

fn prefix_multiplier(p: &str) -> Option<f64> {
    Some(match p {
        "" => 1.0,
        "k" | "K" => 1e3,
        "m" | "M" => 1e6,
        "g" | "G" => 1e9,
        "t" | "T" => 1e12,
        "ki" | "Ki" | "KI" | "kI" => 1024.0,
        "mi" | "Mi" | "MI" | "mI" => 1024.0 * 1024.0,
        "gi" | "Gi" | "GI" | "gI" => 1024.0 * 1024.0 * 1024.0,
        "ti" | "Ti" | "TI" | "tI" => 1024.0f64.powi(4),
        _ => return None,
    })
}

/// Parses a byte size: a number with an optional unit among `B`, `kB`/`KB`, `MB`, `GB`, `TB`
/// (powers of 1000) and `KiB`, `MiB`, `GiB`, `TiB` (powers of 1024), case-insensitive; the
/// trailing `B` may be omitted ("8G", "512Mi"). A plain number is bytes.
pub fn parse_bytes(input: &str) -> Result<u64, ParseError> {
    const ACCEPTED: &str = "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB";
    let (value, unit) = split_number(input)?;
    let prefix = unit
        .strip_suffix('B')
        .or_else(|| unit.strip_suffix('b'))
        .unwrap_or(unit);
    let mult = prefix_multiplier(prefix).ok_or_else(|| ParseError::BadUnit {
        input: input.to_string(),
        unit: unit.to_string(),
        accepted: ACCEPTED,
    })?;
    let bytes = (value * mult).round();
    if bytes > u64::MAX as f64 {
        return Err(ParseError::TooLarge(input.to_string()));
    }
    Ok(bytes as u64)
}

/// Parses a bandwidth into bytes per second (`> 0`): bits as `bit`, `kbit`, `mbit`, `gbit`,
/// `bps`, `Mbps`, `Mb/s`, `Gbit/s`...; bytes as `B/s`, `kB/s`, `MB/s`, `GB/s`, `MiB/s`,
/// `GiB/s`... A plain number is bytes per second.
pub fn parse_bandwidth(input: &str) -> Result<f64, ParseError> {
    const ACCEPTED: &str =
        "bit, kbit, mbit, gbit, Mbps, Mb/s, Gbit/s, B/s, kB/s, MB/s, GB/s, MiB/s, GiB/s";
    let (value, unit) = split_number(input)?;
    let bad = || ParseError::BadUnit {
        input: input.to_string(),
        unit: unit.to_string(),
        accepted: ACCEPTED,
    };
    let (prefix, bits) = if unit.is_empty() {
        ("", false)
    } else if let Some(p) = unit
        .strip_suffix("bit/s")
        .or_else(|| unit.strip_suffix("bit"))
    {
        (p, true)
    } else if let Some(p) = unit.strip_suffix("bps") {
        (p, true)
    } else if let Some(p) = unit.strip_suffix("b/s") {
        (p, true)
    } else if let Some(p) = unit
        .strip_suffix("B/s")
        .or_else(|| unit.strip_suffix("Bps"))
    {
        (p, false)
    } else {
        return Err(bad());
    };
    let mult = prefix_multiplier(prefix).ok_or_else(bad)?;
    let bytes_per_s = value * mult / if bits { 8.0 } else { 1.0 };
    if bytes_per_s <= 0.0 {
        return Err(ParseError::NotPositive(input.to_string()));
    }
    Ok(bytes_per_s)
}

/// Parses a duration into seconds (`>= 0`): `s`, `ms`, `us`/`µs`, `ns`; a plain number is seconds.
pub fn parse_duration(input: &str) -> Result<f64, ParseError> {
    let (value, unit) = split_number(input)?;
    let div = match unit {
        "" | "s" => 1.0,
        "ms" => 1e3,
        "us" | "µs" => 1e6,
        "ns" => 1e9,
        _ => {
            return Err(ParseError::BadUnit {
                input: input.to_string(),
                unit: unit.to_string(),
                accepted: "s, ms, us, ns",
            })
        }
    };
    Ok(value / div)
}

/// Formats bytes with a binary unit, e.g. `13.2 GiB`.
pub fn format_bytes(bytes: u64) -> String {
    let b = bytes as f64;
    let units = [
        ("TiB", 1024f64.powi(4)),
        ("GiB", 1024f64.powi(3)),
        ("MiB", 1024f64.powi(2)),
        ("KiB", 1024.0),
    ];
    for (name, size) in units {
        if b >= size {
            return format!("{:.1} {name}", b / size);
        }
    }
    format!("{bytes} B")
}

/// Formats a bandwidth in bytes per second as Mbit/s, e.g. `100 Mbit/s`.
pub fn format_bandwidth(bytes_per_s: f64) -> String {
    format!("{:.0} Mbit/s", bytes_per_s * 8.0 / 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes() {
        assert_eq!(parse_bytes("300MiB").unwrap(), 300 * 1024 * 1024);
        assert_eq!(parse_bytes("8GB").unwrap(), 8_000_000_000);
        assert_eq!(parse_bytes("8gb").unwrap(), 8_000_000_000);
        assert_eq!(parse_bytes("3GB").unwrap(), 3_000_000_000);
        assert_eq!(parse_bytes("1.5GiB").unwrap(), 1_610_612_736);
        assert_eq!(parse_bytes("1024").unwrap(), 1024);
        assert_eq!(parse_bytes(" 8 GiB ").unwrap(), 8 << 30);
        assert!(parse_bytes("-1GB").is_err());
        assert!(parse_bytes("8 parsecs").is_err());
        assert!(parse_bytes("").is_err());
        assert!(parse_bytes("GB").is_err());
    }

    #[test]
    fn bandwidth() {
        assert_eq!(parse_bandwidth("100mbit").unwrap(), 12.5e6);
        assert_eq!(parse_bandwidth("1gbit").unwrap(), 125e6);
        assert_eq!(parse_bandwidth("50MB/s").unwrap(), 50e6);
        assert_eq!(parse_bandwidth("100Mbps").unwrap(), 12.5e6);
        assert_eq!(parse_bandwidth("100Mb/s").unwrap(), 12.5e6);
        assert_eq!(parse_bandwidth("1MiB/s").unwrap(), 1048576.0);
        assert_eq!(parse_bandwidth("1000").unwrap(), 1000.0);
        assert!(parse_bandwidth("0mbit").is_err());
        assert!(parse_bandwidth("-5mbit").is_err());
        assert!(parse_bandwidth("5 furlongs").is_err());
    }

    #[test]
    fn duration() {
        assert_eq!(parse_duration("2ms").unwrap(), 0.002);
        assert!((parse_duration("150us").unwrap() - 150e-6).abs() < 1e-15);
        assert_eq!(parse_duration("1").unwrap(), 1.0);
        assert!(parse_duration("-1ms").is_err());
        assert!(parse_duration("2 fortnights").is_err());
    }
}
