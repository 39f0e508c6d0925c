// The SQL endpoint's `password` mode (ES_PIPELINE_SQL_ENDPOINT_AUTH=password): HiveServer2's CUSTOM authentication,
// checking a client's user and password against the users file `es-pipeline sql-endpoint --add-user` writes
// (ES_PIPELINE_SQL_ENDPOINT_USERS): one line per user, `user:iterations:salt-hex:hash-hex`, the hash PBKDF2 with
// HMAC-SHA256 of the password. No password is kept, only its hash; the file is read at each login, so a user added or
// removed counts at once. Built with javac on first use (es_pipeline/lake/read/endpoint.py).
package es_pipeline.auth;

import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.MessageDigest;
import java.util.HexFormat;
import javax.crypto.SecretKeyFactory;
import javax.crypto.spec.PBEKeySpec;
import javax.security.sasl.AuthenticationException;
import org.apache.hive.service.auth.PasswdAuthenticationProvider;

public class PasswordFile implements PasswdAuthenticationProvider {
    @Override
    public void Authenticate(String user, String password) throws AuthenticationException {
        String file = System.getenv("ES_PIPELINE_SQL_ENDPOINT_USERS");
        if (file == null || user == null || password == null) {
            throw new AuthenticationException("es_pipeline: no users file");
        }
        try {
            for (String line : Files.readAllLines(Path.of(file), StandardCharsets.UTF_8)) {
                String[] f = line.trim().split(":");
                if (f.length != 4 || !f[0].equals(user)) {
                    continue;
                }
                byte[] salt = HexFormat.of().parseHex(f[2]);
                byte[] want = HexFormat.of().parseHex(f[3]);
                PBEKeySpec spec = new PBEKeySpec(password.toCharArray(), salt, Integer.parseInt(f[1]), want.length * 8);
                byte[] got = SecretKeyFactory.getInstance("PBKDF2WithHmacSHA256").generateSecret(spec).getEncoded();
                if (MessageDigest.isEqual(got, want)) {
                    return;
                }
                break;
            }
        } catch (Exception e) {
            throw new AuthenticationException("es_pipeline: the users file cannot be read", e);
        }
        throw new AuthenticationException("es_pipeline: wrong user or password");
    }
}
