from app.users import check_password, find_user


def login(name, password):
    user = find_user(name)
    if user is None or not check_password(user, password):
        return None
    return user
