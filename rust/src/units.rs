//! Sizes, counts and times as people read and write them: binary units both ways, from one
//! table, counts grouped by thousands, intervals ("100ms", "2min") and UTC timestamps.

use std::time::Duration;

use crate::error::{Error, Result};

/// Units of 1024ⁿ bytes, n being the position: how [`bytes`] writes each, and the spellings a
/// size is read with, in any case. GB and MB mean GiB and MiB, as nvidia-smi and torch mean them.
const UNITS: [(&str, &[&str]); 6] = [
    ("B", &["b", "byte", "bytes"]),
    ("KiB", &["k", "kb", "kib"]),
    ("MiB", &["m", "mb", "mib"]),
    ("GiB", &["g", "gb", "gib"]),
    ("TiB", &["t", "tb", "tib"]),
    ("PiB", &["p", "pb", "pib"]),
];

/// Sizes in binary units, two decimals: what a person reads against `nvidia-smi` and torch.
pub fn bytes(n: u64) -> String {
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 1;
    // Compare after rounding to two decimals, so 1 MiB − 1 B reads "1.00 MiB", not "1024.00 KiB".
    while value >= 1023.995 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit].0)
}

/// A count with its thousands grouped, as a person reads it: `250,000`.
pub fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

pub fn signed_bytes(n: i64) -> String {
    match n {
        0 => "0 B".into(),
        n if n > 0 => format!("+{}", bytes(n as u64)),
        n => format!("-{}", bytes(n.unsigned_abs())),
    }
}

/// Bytes in `number` of `unit` ("2.00" and "GiB", as torch's messages write them), unrounded;
/// None when the number is none or the unit is not in the table.
pub fn size_in_bytes(number: &str, unit: &str) -> Option<f64> {
    let number: f64 = number.parse().ok()?;
    let unit = unit.to_ascii_lowercase();
    let power = UNITS.iter().position(|(_, spellings)| spellings.contains(&unit.as_str()))?;
    Some(number * 1024f64.powi(power as i32))
}

/// The largest size [`parse_size`] takes: more than any machine's memory, far below where
/// arithmetic on it could overflow.
pub const MAX_SIZE: u64 = 1 << 50;

/// Bytes from "24GiB", "512 MiB", "1.5GB" or a plain number: how people write memory sizes.
/// "0" is 0; more than [`MAX_SIZE`] is refused.
/// GB and MB are read as GiB and MiB, as nvidia-smi and torch's messages mean them.
pub fn parse_size(text: &str) -> Result<u64> {
    let text = text.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let unit = match unit.trim() {
        "" => "b",
        unit => unit,
    };
    match size_in_bytes(number, unit) {
        // Refused, never saturated: no machine has more, and past 2^64 `as u64` would clamp.
        Some(value) if value > MAX_SIZE as f64 => Err(Error::InvalidArgument(format!(
            "{text:?} is more memory than any machine has (gpuexp takes sizes up to 1PiB): \
             write a size such as \"24GiB\""
        ))),
        // Zero as a whole: callers that need a positive size say so in their own words.
        Some(0.0) => Ok(0),
        Some(value) if value >= 1.0 => Ok(value as u64),
        _ => Err(Error::InvalidArgument(format!(
            "{text:?} is not a memory size: write it like \"24GiB\", \"512MiB\" or a number of bytes"
        ))),
    }
}

/// A time from "100ms", "1s", "1sec", "2m", "2min" or a plain number of seconds ("0.5").
pub fn parse_interval(text: &str) -> Result<Duration> {
    let not_a_time = || {
        Error::InvalidArgument(format!(
            "interval={text:?}: write a time such as \"100ms\", \"1s\" or a number of seconds"
        ))
    };
    let trimmed = text.trim();
    let split = trimmed.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let unit_seconds = match unit.trim_start() {
        "ms" => 1e-3,
        "" | "s" | "sec" => 1.0,
        "m" | "min" => 60.0,
        _ => return Err(not_a_time()),
    };
    // Digits with at most one point, and a digit after it: "1.5" and ".5", never "1." or "1.2.3".
    let decimal = number.matches('.').count() <= 1 && number.ends_with(|c: char| c.is_ascii_digit());
    let value: f64 = number.parse().ok().filter(|_| decimal).ok_or_else(not_a_time)?;
    positive_interval(value * unit_seconds, &format!("{text:?}"))
}

/// An interval given as a number of seconds, refused unless it is more than 0 and finite.
pub fn interval_of_seconds(seconds: f64) -> Result<Duration> {
    positive_interval(seconds, &seconds.to_string())
}

/// `seconds` as a Duration; `shown` is how the user wrote it, for the message.
fn positive_interval(seconds: f64, shown: &str) -> Result<Duration> {
    match Duration::try_from_secs_f64(seconds) {
        Ok(interval) if !interval.is_zero() => Ok(interval),
        // Infinite, or past what a Duration holds (some 10¹⁹ seconds).
        Err(_) if seconds > 0.0 => Err(Error::InvalidArgument(format!(
            "interval={shown}: write a finite time such as \"100ms\", \"1s\" or a number of seconds"
        ))),
        // Zero, negative, NaN, or under a nanosecond.
        _ => Err(Error::InvalidArgument(format!("interval={shown}: it must be more than 0, e.g. interval=\"100ms\""))),
    }
}

/// Serialises a Unix time as RFC 3339 (`#[serde(serialize_with = ...)]`): every time in gpuexp's
/// JSON is written the same way, whatever struct carries it.
pub fn serialize_rfc3339<S: serde::Serializer>(
    unix_seconds: &f64,
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    serializer.serialize_str(&rfc3339(*unix_seconds))
}

/// Reads back what [`serialize_rfc3339`] wrote (`#[serde(deserialize_with = ...)]`), to the
/// millisecond it keeps.
pub fn deserialize_rfc3339<'de, D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<f64, D::Error> {
    let text = <String as serde::Deserialize>::deserialize(deserializer)?;
    unix_seconds(&text).ok_or_else(|| serde::de::Error::custom(format!("{text:?} is not an RFC 3339 UTC time")))
}

/// Seconds since the Unix epoch of "2026-11-25T22:53:45.123Z", as [`rfc3339`] writes it.
fn unix_seconds(text: &str) -> Option<f64> {
    let text = text.strip_suffix('Z')?;
    let (date, time) = text.split_once('T')?;
    let mut date = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (year, month, day) = (date.next()??, date.next()??, date.next()??);
    let mut time = time.splitn(3, ':');
    let (hours, minutes) = (time.next()?.parse::<i64>().ok()?, time.next()?.parse::<i64>().ok()?);
    let seconds = time.next()?.parse::<f64>().ok()?;
    // Howard Hinnant's days-from-civil algorithm, the inverse of the one `rfc3339` uses.
    let year = year - i64::from(month <= 2);
    let era = year.div_euclid(400);
    let yoe = year - era * 400;
    let doy = (153 * (month + if month > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((days * 86_400 + hours * 3600 + minutes * 60) as f64 + seconds)
}

/// UTC time as RFC 3339, without pulling in a date crate for one format.
pub fn rfc3339(unix_seconds: f64) -> String {
    let secs = unix_seconds.floor() as i64;
    let millis = ((unix_seconds - secs as f64) * 1000.0).round().min(999.0) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's days-to-civil algorithm.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    #[test]
    fn counts_group_their_thousands() {
        let cases = [(0, "0"), (999, "999"), (1000, "1,000"), (100_000, "100,000"), (1_234_567, "1,234,567")];
        for (n, text) in cases {
            assert_eq!(count(n), text);
        }
    }

    // --- bytes ----------------------------------------------------------------------------

    #[test]
    fn bytes_are_shown_in_binary_units_with_two_decimals() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1), "1 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(KIB), "1.00 KiB");
        assert_eq!(bytes(MIB + MIB / 2), "1.50 MiB");
        assert_eq!(bytes(GIB), "1.00 GiB");
        assert_eq!(bytes(80 * GIB), "80.00 GiB");
        assert_eq!(bytes(1 << 40), "1.00 TiB");
        assert_eq!(bytes(1 << 50), "1.00 PiB");
    }

    #[test]
    fn huge_sizes_stay_in_the_largest_unit() {
        assert_eq!(bytes(1 << 60), "1024.00 PiB");
        assert_eq!(bytes(u64::MAX), "16384.00 PiB");
    }

    #[test]
    fn a_size_that_rounds_up_to_the_next_unit_is_shown_in_that_unit() {
        assert_eq!(bytes(MIB - 1), "1.00 MiB");
        assert_eq!(bytes(GIB - 1), "1.00 GiB");
    }

    #[test]
    fn signed_bytes_show_the_direction() {
        assert_eq!(signed_bytes(0), "0 B");
        assert_eq!(signed_bytes(1023), "+1023 B");
        assert_eq!(signed_bytes(-1023), "-1023 B");
        assert_eq!(signed_bytes(GIB as i64), "+1.00 GiB");
        assert_eq!(signed_bytes(-((MIB + MIB / 2) as i64)), "-1.50 MiB");
        assert_eq!(signed_bytes(i64::MAX), "+8192.00 PiB");
        assert_eq!(signed_bytes(i64::MIN), "-8192.00 PiB");
    }

    // --- reading sizes --------------------------------------------------------------------

    #[test]
    fn rfc3339_times_read_back_to_the_millisecond() {
        for t in [0.0, 951_782_400.5, 1_764_111_225.123, 4_107_542_400.999] {
            let back = unix_seconds(&rfc3339(t)).unwrap();
            assert!((back - t).abs() < 5e-4, "{t} -> {} -> {back}", rfc3339(t));
        }
        assert_eq!(unix_seconds("yesterday"), None);
    }

    #[test]
    fn sizes_are_read_as_people_write_them() {
        assert_eq!(parse_size("24GiB"), Ok(24 << 30));
        assert_eq!(parse_size(" 1.5 GB "), Ok(3 << 29));
        assert_eq!(parse_size("512mib"), Ok(512 << 20));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4096 bytes"), Ok(4096));
        assert_eq!(parse_size("2k"), Ok(2048));
        assert_eq!(parse_size("1.5"), Ok(1), "a fraction of a byte is cut off");
        assert_eq!(parse_size("0"), Ok(0), "as the number 0 is taken");
        assert_eq!(parse_size("0GiB"), Ok(0));
        assert_eq!(parse_size("1024TiB"), Ok(MAX_SIZE));
        for huge in ["9999999GiB", "1025TiB", "1180591620717411303424"] {
            let refused = parse_size(huge).unwrap_err();
            assert!(matches!(&refused, Error::InvalidArgument(m) if m.contains("1PiB")), "{huge}: {refused:?}");
        }
        for bad in ["", "GiB", "24 parsecs", "-3GiB", "0.5", "1e3", "24 GiB extra"] {
            let refused = parse_size(bad).unwrap_err();
            assert!(matches!(&refused, Error::InvalidArgument(m) if m.contains("24GiB")), "{bad}: {refused:?}");
        }
    }

    #[test]
    fn torch_spellings_of_a_size_are_read_in_any_case() {
        assert_eq!(size_in_bytes("2.00", "GiB"), Some((2 * GIB) as f64));
        assert_eq!(size_in_bytes("20.00", "MiB"), Some((20 * MIB) as f64));
        assert_eq!(size_in_bytes("512", "bytes"), Some(512.0));
        assert_eq!(size_in_bytes("1", "gib"), size_in_bytes("1", "GB"));
        assert_eq!(size_in_bytes("0.5", "KiB"), Some(512.0));
        assert_eq!(size_in_bytes("2.00", "parsecs"), None);
        assert_eq!(size_in_bytes("lots", "GiB"), None);
        assert_eq!(size_in_bytes("2", ""), None, "a unit is asked for; parse_size supplies bytes itself");
    }

    #[test]
    fn what_bytes_writes_reads_back() {
        for n in [512, 3 * KIB, 5 * MIB, 7 * GIB, 9 << 40, MAX_SIZE] {
            let shown = bytes(n);
            assert_eq!(parse_size(&shown), Ok(n), "{shown}");
        }
    }

    // --- reading intervals ----------------------------------------------------------------

    #[test]
    fn intervals_are_read_in_milliseconds_seconds_or_minutes() {
        let ms = Duration::from_millis;
        assert_eq!(parse_interval("100ms"), Ok(ms(100)));
        assert_eq!(parse_interval(" 100 ms "), Ok(ms(100)));
        assert_eq!(parse_interval("1s"), Ok(ms(1000)));
        assert_eq!(parse_interval("1.5sec"), Ok(ms(1500)));
        assert_eq!(parse_interval("2min"), Ok(ms(120_000)));
        assert_eq!(parse_interval("2m"), Ok(ms(120_000)));
        assert_eq!(parse_interval("0.25"), Ok(ms(250)), "a plain number is seconds");
        assert_eq!(parse_interval(".5s"), Ok(ms(500)));
    }

    #[test]
    fn what_is_not_a_time_is_refused_with_how_to_write_one() {
        for bad in ["", "fast", "ms", "1.", "1.2.3", "-1s", "1e3", "100 MS", "1h", "1 0ms", "100ms extra", "inf"] {
            let refused = parse_interval(bad).unwrap_err();
            let expected = format!("interval={bad:?}: write a time such as \"100ms\", \"1s\" or a number of seconds");
            assert_eq!(refused, Error::InvalidArgument(expected), "{bad}");
        }
    }

    #[test]
    fn an_interval_must_be_more_than_zero_and_finite() {
        for zero in ["0", "0ms", "0.0min", "0.0000000001"] {
            let refused = parse_interval(zero).unwrap_err();
            assert!(matches!(&refused, Error::InvalidArgument(m) if m.contains("must be more than 0")), "{refused:?}");
        }
        for number in [0.0, -1.0, f64::NAN] {
            let refused = interval_of_seconds(number).unwrap_err();
            assert!(matches!(&refused, Error::InvalidArgument(m) if m.contains("must be more than 0")), "{refused:?}");
        }
        let huge = "9".repeat(400);
        for refused in [interval_of_seconds(f64::INFINITY), interval_of_seconds(1e300), parse_interval(&huge)] {
            assert!(matches!(&refused, Err(Error::InvalidArgument(m)) if m.contains("finite")), "{refused:?}");
        }
        assert_eq!(interval_of_seconds(0.1), Ok(Duration::from_millis(100)));
    }

    // --- rfc3339 --------------------------------------------------------------------------

    #[test]
    fn rfc3339_formats_utc_with_milliseconds() {
        assert_eq!(rfc3339(0.0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_700_000_000.25), "2023-11-14T22:13:20.250Z");
        assert_eq!(rfc3339(1_700_000_000.0 + 0.001), "2023-11-14T22:13:20.001Z");
        assert_eq!(rfc3339(253_402_300_799.0), "9999-12-31T23:59:59.000Z");
    }

    #[test]
    fn rfc3339_handles_leap_days_and_century_years() {
        assert_eq!(rfc3339(1_709_164_800.0), "2024-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(1_709_251_199.5), "2024-02-29T23:59:59.500Z");
        assert_eq!(rfc3339(1_709_251_200.0), "2024-03-01T00:00:00.000Z");
        // 2000 is a leap year (divisible by 400), 2100 is not (divisible by 100).
        assert_eq!(rfc3339(951_782_400.0), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(4_107_542_400.0 - 86_400.0), "2100-02-28T00:00:00.000Z");
        assert_eq!(rfc3339(4_107_542_400.0), "2100-03-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_704_067_199.0), "2023-12-31T23:59:59.000Z");
    }

    #[test]
    fn rfc3339_before_the_epoch_counts_backwards() {
        assert_eq!(rfc3339(-1.0), "1969-12-31T23:59:59.000Z");
        assert_eq!(rfc3339(-0.5), "1969-12-31T23:59:59.500Z");
    }

    #[test]
    fn rfc3339_never_shows_a_thousandth_millisecond() {
        let shown = rfc3339(1_700_000_000.999_9);
        assert!(shown.ends_with(".999Z") || shown == "2023-11-14T22:13:21.000Z", "{shown}");
    }
}
